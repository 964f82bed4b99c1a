"""The chat screen: transcript and prompt on the left, the live cache panel on the right.

It wires widgets to the bridge and the session and holds the little state a reply needs: the id of
the generation being shown (`gen_id`), its widget, and the text received but not yet shown. Messages
from an older generation (one the user stopped with Escape) are ignored, so a stop is immediate on
screen even though the engine finishes its current decode step first.

A `TokensArrived` doorbell schedules `flush_reply`, which takes every waiting token from the bridge,
commits the batch to the store and appends it to the Markdown stream, every `governor.interval()`
seconds (10 times a second at most, fewer when the UI thread is busy). Drawing per token would re-lay
out the screen per token while holding the GIL the generating thread needs (it halved a small model's
decode speed on a CPU). A batch is committed as it is drawn, so a kill loses at most the text of the
last fraction of a second, which never reached the screen either.
"""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Label

from ..bridge import EngineBridge, policy_names, prefetch_modes
from ..livestats import RefreshGovernor, fmt_pct, fmt_rate
from ..messages import (
    CacheRetuned,
    EngineFailed,
    EngineReady,
    GenerationFailed,
    GenerationFinished,
    HitCurveReady,
    LoadProgress,
    ModelInfo,
    PolicyPredicted,
    RetuneFailed,
    StatsUpdated,
    TokensArrived,
)
from ..session import ChatSession
from ..store import export_file
from ..widgets.dashboard import Dashboard
from ..widgets.header import ScreenHeader
from ..widgets.keyfooter import KeyFooter
from ..widgets.loading import LoadingPanel
from ..widgets.prompt import PromptInput
from ..widgets.text import plural
from ..widgets.transcript import AssistantMessage, Transcript
from ..widgets.tuning import NATIVE_NAMES, StepInput, TuningPanel
from .chats import ChatsScreen
from .dialogs import (
    ExportScreen,
    FormatScreen,
    OpenModelScreen,
    SamplingScreen,
    SystemPromptScreen,
    format_change_text,
)

# The panel redraws at most 4 times a second, whatever the governor says: a redraw repaints only the labels,
# sparkline and heatmap rows that changed (~1-2 ms of the UI thread), and bench/tui_overhead.py measures it
# against the hidden panel on the real engine.
STATS_MIN_INTERVAL_S = 0.25


def summary_line(stats, info: ModelInfo | None) -> str:
    """The collapsed panel: 'hit 28% turn · 93% session · 8/96 slots lrfu-layered · 41.7 tok/s · F4 panel'."""
    if info is None:
        return "model loading… · F4 panel"
    parts = []
    if stats is not None and stats.has_cache:
        parts.append(f"hit {fmt_pct(stats.turn_hit_rate)} turn · {fmt_pct(stats.hit_rate)} session")
        parts.append(f"{stats.num_slots}/{info.cache.max_slots if info.cache else '?'} slots {stats.policy}")
    elif info.cache is None:
        parts.append("every expert resident")
    else:
        parts.append(f"{info.cache.slots}/{info.cache.max_slots} slots {info.cache.policy}")
    if stats is not None and stats.decode_tps is not None:
        parts.append(f"{fmt_rate(stats.decode_tps)} tok/s")
    return " · ".join(parts) + " · F4 panel"


class ChatScreen(Screen):
    # Every control has a key in the footer, none cut off at 80 columns (two rows there: widgets/keyfooter.py;
    # tests/app/test_snapshots.py, test_keyboard.py).
    # Escape stops a reply; otherwise it brings focus back to the prompt (and closes an opened panel).
    BINDINGS = [
        Binding("escape", "stop", "Stop", show=True),
        Binding("escape", "focus_prompt", "Prompt", show=True),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+r", "regenerate", "Redo", tooltip="Regenerate the last reply"),
        Binding("ctrl+o", "open_chats", "Chats"),
        Binding("ctrl+s", "export", "Export"),
        Binding("f2", "system_prompt", "System"),
        Binding("f3", "sampling", "Sampling"),
        Binding("f4", "toggle_dashboard", "Panel"),
        Binding("f6", "tune", "Tune", priority=True),  # before the prompt's own F6 (select line)
        # Ctrl+L works always; the footer shows it while no model is loaded (the failed load's notice names it)
        Binding("ctrl+l", "open_model(True)", "Open model"),
        Binding("ctrl+l", "open_model", "Open model", show=False),
        Binding("f5", "setup", "Models", tooltip="Get models: the setup wizard"),
    ]  # and the app's Ctrl+Q Quit
    # Under 100 columns or 30 rows the panel collapses to one summary line above the prompt; F4/F6 open it
    # in place of the transcript (the prompt stays).
    HORIZONTAL_BREAKPOINTS = [(0, "-collapsed"), (100, "-narrow"), (110, "-normal"), (170, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]

    def __init__(self, model: str, hint: str = ""):
        super().__init__()
        self.model = model
        self.hint = hint  # a line above the prompt until the first message (the demo model: where models come from)
        self.queued: str | None = None  # a message sent while the model loads: sent when it is ready
        self.model_loading = False  # not `loading`: that is Textual's reactive that covers the screen with a spinner
        self._reopen = False  # the last chat with this model is still to be reopened (at start)
        self._tuned: set[str] = set()  # the knobs the user set in this session (saved per model)
        self.info: ModelInfo | None = None
        self.gen_id: int | None = None
        self.reply: AssistantMessage | None = None
        self._flush_timer = None
        self.last_stats = None
        self.governor = RefreshGovernor()  # paces the streamed text (see livestats.py)
        self._stats_pending = False  # last_stats not drawn yet
        self.bridge = EngineBridge(self.app.engine_factory, self.app.load_options)
        self.session = ChatSession(self.app.store, model, self.app.settings.system_prompt)

    # -- layout ---------------------------------------------------------------------------------------
    def compose(self):
        yield ScreenHeader(icon="◆")
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield LoadingPanel(id="loading")
                yield Transcript(id="transcript")
                yield Label(self.hint, id="chat-hint", classes="hint", markup=False)
                yield Label("", id="summary", markup=False)
                yield PromptInput(self.app.prompt_history(), id="prompt")
            yield Dashboard(policy_names(), memory_probe=self.app.memory_probe, prefetch_modes=prefetch_modes(),
                            id="dashboard")
        yield KeyFooter(compact=True)
        yield self.bridge

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def dashboard(self) -> Dashboard:
        return self.query_one(Dashboard)

    def on_mount(self) -> None:
        # One interval timer draws the newest stats: a Timer per StatsUpdated cost an asyncio task each.
        self.set_interval(STATS_MIN_INTERVAL_S, self._show_stats)
        self.sub_title = f"{Path(self.model).name} · loading"
        self.set_class(not self.app.settings.show_dashboard, "-panel-hidden")
        self.query_one("#chat-hint", Label).display = bool(self.hint)
        self.query_one(PromptInput).focus()
        self.load(self.model)
        self._reopen = self.app.reopen_last_chat  # the last chat with this model, as it was left
        self._reopen_last_chat(self.model)

    def _reopen_last_chat(self, *models: str) -> None:
        """Open the latest saved chat with one of `models` (a path as typed or resolved, a repo id), once."""
        if not self._reopen or self.session.turns:
            return
        names = set(models) | {str(Path(m).expanduser().resolve()) for m in models if m}
        last = next((c for c in self.app.store.list_conversations(limit=50) if c.model in names), None)
        if last is not None:
            self._reopen = False
            self.call_later(self.open_conversation, last.id)

    def on_unmount(self) -> None:
        self.bridge.stop()

    def load(self, model: str) -> None:
        self.model = model
        self.info = None
        self.model_loading = True
        self._tuned = set()  # per model
        self.query_one(LoadingPanel).show_stage(Path(model).name, "starting", 0.0)
        self.dashboard.show_model(None, loading=f"loading {Path(model).name}…")
        self.refresh_bindings()  # Ctrl+L leaves the footer
        # After the next refresh: the load worker's `import torch` holds the GIL for most of a second, and
        # started here it would hold back the first frame by about as much (bench/startup.py).
        self.call_after_refresh(self.bridge.load, model, expert_format=self.app.expert_format(model))

    # -- engine messages ------------------------------------------------------------------------------
    def on_load_progress(self, message: LoadProgress) -> None:
        if message.stage.startswith("warning: "):
            self.notify(message.stage.removeprefix("warning: "), title="Memory plan", severity="warning",
                        timeout=12)
            return
        self.query_one(LoadingPanel).show_stage(Path(self.model).name, message.stage, message.elapsed)

    def on_engine_ready(self, message: EngineReady) -> None:
        info = self.info = message.info
        self.session.model = info.path
        self.query_one(LoadingPanel).hide()
        self.sub_title = f"{info.name} · {info.model_type} · {info.device} · {info.dtype}"
        self.dashboard.show_model(info, tuning_note=self.app.tuning_note)
        self.model_loading = False
        self.refresh_bindings()
        self._restore_tuning(info)
        if self.queued is None:
            self._reopen_last_chat(info.path)  # a repo id's chats are saved under its snapshot's path
        self._reopen = False
        settings = self.app.settings
        settings.remember_model(info.path)
        problem = settings.save()
        if problem:
            self.notify(problem, severity="warning")
        if not info.has_chat_template:
            self.notify("This model has no chat template, so it cannot chat here; `moechat run --raw` completes "
                        "plain text.", severity="warning", timeout=12)
        if self.queued is not None:  # typed while it loaded: answer it now
            self.queued = None
            self.call_later(self._start_reply)

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.model_loading = False
        if self.queued is not None:  # the message stays in the chat (saved); it is answered after a load that works
            self.queued = None
        self.sub_title = f"{Path(self.model).name} · not loaded"
        self.query_one(LoadingPanel).show_error(Path(self.model).name, message.error)
        self.dashboard.show_model(None, loading="no model loaded")
        self.refresh_bindings()  # Ctrl+L, which the notice names, in the footer
        self.notify(message.error, title="Model failed to load", severity="error", timeout=12)

    def on_tokens_arrived(self, message: TokensArrived) -> None:
        if message.gen_id != self.gen_id or self.reply is None:
            self.bridge.take_tokens()  # a stopped reply's last tokens: dropped, and the doorbell re-armed
            return
        if self._flush_timer is None:
            self._flush_timer = self.set_timer(self.governor.interval(), self.flush_reply)

    async def flush_reply(self) -> None:
        """Take the waiting tokens, commit them to the store and draw them."""
        self._flush_timer = None
        batches = [t for t in self.bridge.take_tokens() if t.gen_id == self.gen_id]
        text = "".join(t.text for t in batches)
        thinking = "".join(t.thinking for t in batches)
        if (text or thinking) and self.reply is not None:
            self.session.append_reply(text, thinking)
            await self.reply.write(text, thinking)

    async def on_generation_finished(self, message: GenerationFinished) -> None:
        if message.gen_id != self.gen_id:
            return
        status = "stopped" if message.finish_reason == "cancelled" else "done"
        footer = f"{plural(message.generated_tokens, 'token')} · {fmt_rate(message.decode_tps)} tok/s"
        if message.finish_reason == "length":
            footer += " · hit the max tokens limit"
        stats = {"finish_reason": message.finish_reason, "prompt_tokens": message.prompt_tokens,
                 "generated_tokens": message.generated_tokens, "prefill_tps": message.prefill_tps,
                 "decode_tps": message.decode_tps}
        await self._end_reply(status, footer, stats)

    async def on_generation_failed(self, message: GenerationFailed) -> None:
        if message.gen_id != self.gen_id:
            return
        self.notify(message.error, title="Generation failed", severity="error", timeout=10)
        await self._end_reply("error", message.error)

    def on_stats_updated(self, message: StatsUpdated) -> None:
        self.last_stats = message.stats
        self._stats_pending = True

    def _show_stats(self) -> None:
        if not self._stats_pending or self.last_stats is None:
            return
        if self.dashboard.display:
            self._stats_pending = False
            self.dashboard.show_stats(self.last_stats)
        elif self.query_one("#summary", Label).display:
            self._stats_pending = False
            self._show_summary()

    def _show_summary(self) -> None:
        """The collapsed panel's one line: hit rates (this reply, session), slots and policy, decode tok/s."""
        self.query_one("#summary", Label).update(summary_line(self.last_stats, self.info), layout=False)

    def on_hit_curve_ready(self, message: HitCurveReady) -> None:
        self.query_one(TuningPanel).show_curve(message.curve)

    def on_tuning_panel_prediction_wanted(self, message: TuningPanel.PredictionWanted) -> None:
        self.bridge.predict(message.policy, message.slots)

    def on_policy_predicted(self, message: PolicyPredicted) -> None:
        r = message.result
        self.query_one(TuningPanel).show_replay(r.policy, r.slots, r.warm_rate)

    def on_cache_retuned(self, message: CacheRetuned) -> None:
        # Said in the panel's "now:" line, not a toast: a toast would cover the knobs being used.
        self.query_one(TuningPanel).show_state(message.state, at_token=message.at_token)
        self._save_tuning(message.state)

    def on_retune_failed(self, message: RetuneFailed) -> None:
        self.notify(message.error, title="Cache not changed", severity="error", timeout=8)
        if self.info is not None:
            self.query_one(TuningPanel).show_state(self.query_one(TuningPanel).state)

    def on_tuning_panel_changed(self, message: TuningPanel.Changed) -> None:
        if message.done:  # a value applied with Enter, or a pick in a dropdown: typing goes to the prompt again
            self.query_one(PromptInput).focus()
        if self.info is None:
            return
        changed = (("slots", message.expert_slots), ("policy", message.policy),
                   ("ram_cache_mb", message.ram_cache_bytes), ("prefetch", message.prefetch))
        self._tuned |= {key for key, value in changed if value is not None}
        self.bridge.retune(expert_slots=message.expert_slots, policy=message.policy,
                           ram_cache_bytes=message.ram_cache_bytes, prefetch=message.prefetch)

    def _save_tuning(self, state) -> None:
        """The knobs the user set (now or before), at their effective values, saved for this model (applied at its
        next load); the rest stay the planner's, which follows this machine's free memory."""
        if state is None or self.info is None:
            return
        keys = self._tuned | set(self.app.settings.tuning(self.info.path))
        if not keys:
            return
        values = {"slots": state.slots, "policy": state.policy, "ram_cache_mb": state.ram_budget_bytes >> 20,
                  "prefetch": state.prefetch}
        self.app.settings.set_tuning(self.info.path, **{k: v for k, v in values.items() if k in keys})
        problem = self.app.settings.save()
        if problem:
            self.notify(problem, severity="warning")

    def _restore_tuning(self, info: ModelInfo) -> None:
        """The tuning saved for this model, unless this session's command line set it."""
        saved, options, state = self.app.settings.tuning(info.path), self.app.load_options, info.cache
        if not saved or state is None or options.resident or self.app.tuning_note:
            return
        changes = {}
        if options.expert_slots is None and saved.get("slots") and saved["slots"] != state.slots:
            changes["expert_slots"] = min(saved["slots"], state.max_slots)
        if options.policy is None and saved.get("policy") and saved["policy"] != state.policy:
            changes["policy"] = saved["policy"]
        if options.ram_cache_mb is None and "ram_cache_mb" in saved and saved["ram_cache_mb"] << 20 != \
                state.ram_budget_bytes:
            changes["ram_cache_bytes"] = saved["ram_cache_mb"] << 20
        if options.prefetch is None and saved.get("prefetch") and saved["prefetch"] != state.prefetch:
            changes["prefetch"] = saved["prefetch"]
        if changes:
            self.bridge.retune(**changes)

    def on_tuning_panel_format_chosen(self, message: TuningPanel.FormatChosen) -> None:
        """Another expert format: confirm (it reloads, and a first conversion writes a repacked file), then reload."""
        info, tuning = self.info, self.query_one(TuningPanel)
        if info is None:
            tuning.reset_format()
            return
        fmt, model = message.expert_format, self.model
        size, repacked = info.format_bytes.get(fmt), fmt in info.repacked
        native = NATIVE_NAMES.get(info.native_format) or info.dtype

        def done(confirmed: bool | None) -> None:
            self.query_one(PromptInput).focus()  # confirmed or not, typing goes to the prompt again
            if not confirmed:
                tuning.reset_format()
                return
            problem = self.app.choose_expert_format(model, fmt)
            if problem:
                self.notify(problem, severity="warning")
            self.notify(format_change_text(info.name, fmt, size, repacked, native), title="Expert format", timeout=15)
            self.call_later(self._reload, model)

        self.app.push_screen(FormatScreen(info.name, fmt, size, repacked, native), done)

    # -- sending and replies --------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def _send(self, event: PromptInput.Submitted) -> None:
        if self.info is None and not (self.model_loading and self.queued is None):
            why = "one message already waits for it" if self.queued is not None else "it failed to load"
            self.notify(f"The model is not loaded ({why}); your message is kept in the prompt.", severity="warning")
            return
        if self.gen_id is not None:
            self.notify("Still replying: press Escape to stop it first.", severity="warning")
            return
        event.prompt.remember(event.text)
        event.prompt.clear()
        self.query_one("#chat-hint", Label).display = False
        self.session.add_user(event.text)
        await self.transcript.add_user(event.text)
        if self.info is None:  # still loading: sent when it is ready
            self.queued = event.text
            self.notify("Queued: sent when the model has loaded.", timeout=4)
            return
        await self._start_reply()

    async def _start_reply(self) -> None:
        request = self.session.request()
        if request is None:
            return
        history, text = request
        self.session.start_reply()
        self.reply = await self.transcript.add_assistant()
        self.transcript.scroll_end(animate=False)
        sampling, max_tokens = self.app.sampling()  # the settings, under `moechat chat --temperature ...`
        self.gen_id = self.bridge.generate(history, text, sampling, max_tokens, self.template_kwargs())
        self.refresh_bindings()  # Escape: Stop

    def template_kwargs(self) -> dict:
        """Chat template variables for the next reply: the reasoning effort and the thinking switch, where the
        template reads them.

        Unset (no --reasoning-effort / --thinking, none chosen in the sampling dialog), nothing is passed and the
        template's own default applies (gpt-oss: "medium"; Qwen: thinking on; Gemma 4: off)."""
        out = {}
        effort = self.app.reasoning_effort or self.app.settings.reasoning_effort
        if effort and self.info is not None and self.info.reads_reasoning_effort:
            out["reasoning_effort"] = effort
        thinking = self.app.thinking if self.app.thinking is not None else self.app.settings.thinking
        if thinking is not None and self.info is not None and self.info.thinking_switch:
            out["enable_thinking"] = thinking  # the engine's templates and moechat serve both take this name
        return out

    async def _end_reply(self, status: str, footer: str = "", stats: dict | None = None) -> None:
        if self._flush_timer is not None:
            self._flush_timer.stop()
        await self.flush_reply()
        self.gen_id = None
        self.refresh_bindings()  # Escape: Prompt
        self.session.finish_reply(status, stats)
        reply, self.reply = self.reply, None
        if reply is not None:
            await reply.finish(status, footer, error=footer if status == "error" else "")

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # Escape is "Stop" while a reply streams and "Prompt" otherwise; the footer shows the one that applies.
        if action == "stop":
            return self.gen_id is not None
        if action == "focus_prompt":
            return self.gen_id is None
        if action == "open_model":  # the shown Ctrl+L while no model is loaded, the hidden one otherwise
            return bool(parameters) == self.load_failed
        return True

    @property
    def load_failed(self) -> bool:
        """No model loaded and none loading: the last load failed."""
        return self.info is None and not self.model_loading

    async def action_stop(self) -> None:
        if self.gen_id is None:
            return
        self.bridge.stop()
        await self._end_reply("stopped")
        self.action_focus_prompt()

    def action_focus_prompt(self) -> None:
        """Back to the prompt from anywhere (an opened panel in a small terminal closes)."""
        self.remove_class("-panel-open")
        self.query_one(PromptInput).focus()

    def action_tune(self) -> None:
        """The knobs: the panel shown (opened over the transcript in a small terminal), the slots knob focused."""
        self.remove_class("-panel-hidden")
        if self.collapsed:
            self.add_class("-panel-open")
        self._draw_panel()
        knob = self.query_one("#slots", StepInput)
        unavailable = self.query_one(TuningPanel).unavailable
        if unavailable is not None:  # a remote server: the panel says why in place of the knobs
            self.notify(unavailable, severity="warning")
            return
        if knob.disabled:
            self.notify("The knobs work once the model has loaded with an expert cache.", severity="warning")
            return

        def show() -> None:
            knob.focus(scroll_visible=False)
            self.dashboard.scroll_to_widget(self.query_one(TuningPanel), top=True, animate=False)

        self.call_after_refresh(show)

    @property
    def collapsed(self) -> bool:
        """A small terminal: the panel is one line above the prompt unless opened with F4/F6."""
        return self.has_class("-collapsed") or self.has_class("-short")

    async def action_regenerate(self) -> None:
        if self.info is None:
            return
        await self.action_stop()
        if not self.session.turns:
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        if self.session.drop_last_reply():
            replies = self.transcript.assistant_messages
            if replies:
                await replies[-1].remove()
        await self._start_reply()

    async def action_new_chat(self) -> None:
        await self.action_stop()
        self.session = ChatSession(self.app.store, self.session.model, self.app.settings.system_prompt)
        await self.transcript.clear_messages()
        self.query_one(PromptInput).focus()

    async def open_conversation(self, conversation_id: int) -> None:
        session = ChatSession.open(self.app.store, conversation_id, self.session.model)
        if session is None:
            self.notify("That chat no longer exists.", severity="warning")
            return
        await self.action_stop()
        self.session = session
        transcript = self.transcript
        await transcript.clear_messages()
        for turn in session.turns:
            if turn.role == "user":
                await transcript.add_user(turn.content)
            else:
                stats = turn.stats or {}
                footer = (f"{plural(stats['generated_tokens'], 'token')} · {fmt_rate(stats['decode_tps'])} tok/s"
                          if "generated_tokens" in stats else "")
                await transcript.add_assistant(turn.content, turn.status, footer, turn.thinking)
        transcript.scroll_end(animate=False)
        self.query_one("#chat-hint", Label).display = self.hint != "" and not session.turns
        self.query_one(PromptInput).focus()

    # -- dialogs --------------------------------------------------------------------------------------
    def action_open_chats(self) -> None:
        async def done(result: tuple[str, int] | None) -> None:
            if result is None:
                return
            what, conversation_id = result
            if what == "open":
                await self.open_conversation(conversation_id)
            else:
                self._export(conversation_id)

        def forget(conversation_id: int) -> None:
            """The list deleted a chat: if it is the one on screen, the screen starts a new one."""
            if conversation_id == self.session.conversation_id:
                self.call_later(self.action_new_chat)

        self.app.push_screen(ChatsScreen(self.app.store, on_delete=forget), done)

    def action_export(self) -> None:
        if self.session.conversation_id is None:
            self.notify("Nothing to export yet.", severity="warning")
            return
        self._export(self.session.conversation_id)

    def _export(self, conversation_id: int) -> None:
        """Ask where (the data dir's exports folder offered), then write the Markdown there."""

        def done(directory: str | None) -> None:
            if directory is None:
                return
            try:
                path = export_file(self.app.store, conversation_id, Path(directory).expanduser())
            except OSError as e:
                self.notify(f"Export failed: {e.strerror or e}", severity="error")
                return
            self.app.export_dir = path.parent
            self.notify(f"Exported to {path}", title="Export", timeout=8)

        self.app.push_screen(ExportScreen(str(self.app.export_dir)), done)

    def action_system_prompt(self) -> None:
        def done(text: str | None) -> None:
            if text is None:
                return
            self.session.set_system(text)
            self.app.settings.system_prompt = text
            self.app.settings.save()
            self.notify("System prompt set." if text else "System prompt cleared.", timeout=3)

        self.app.push_screen(SystemPromptScreen(self.session.system), done)

    def action_sampling(self) -> None:
        info = self.info
        if info is None:
            self.notify("The model's defaults are known once it is loaded.", severity="warning")
            return
        settings = self.app.settings

        def done(result) -> None:
            if result is None:
                return
            settings.sampling, settings.max_tokens = result.sampling, result.max_tokens
            self.app.choose_sampling()  # the choice made here replaces the command line's for this session
            if info.reads_reasoning_effort:
                settings.reasoning_effort = result.reasoning_effort
                self.app.reasoning_effort = None  # the choice made here replaces --reasoning-effort's
            if info.thinking_switch:
                settings.thinking = result.thinking
                self.app.thinking = None  # and --thinking's
            settings.save()

        effort = self.app.reasoning_effort or settings.reasoning_effort
        thinking = self.app.thinking if self.app.thinking is not None else settings.thinking
        sampling, max_tokens = self.app.sampling()
        dialog = SamplingScreen(info.sampling_defaults, info.generation_config, sampling, max_tokens,
                                info.default_max_tokens, reasoning_effort=effort,
                                reads_reasoning_effort=info.reads_reasoning_effort,
                                thinking=thinking, thinking_switch=info.thinking_switch)
        self.app.push_screen(dialog, done)

    def action_toggle_dashboard(self) -> None:
        if self.collapsed:  # a small terminal: open the panel over the transcript, or close it
            self.toggle_class("-panel-open")
            if not self.has_class("-panel-open"):
                self.query_one(PromptInput).focus()
        else:
            self.toggle_class("-panel-hidden")
            self.app.settings.show_dashboard = not self.has_class("-panel-hidden")
            self.app.settings.save()
        self._draw_panel()

    def _draw_panel(self) -> None:
        """Draw the latest stats on whichever is shown now (panel or summary line), once the CSS has applied."""

        def draw() -> None:
            self._stats_pending = self.last_stats is not None
            self._show_stats()

        self.call_after_refresh(draw)

    def action_open_model(self, shown: bool = False) -> None:
        def done(model: str | None) -> None:
            if model:
                self.call_later(self._reload, model)

        self.app.push_screen(OpenModelScreen(self.app.settings.recent_models), done)

    def action_setup(self) -> None:
        """The setup wizard: catalog, verdicts for this machine, download; its model replaces this one."""
        self.app.open_setup()

    async def _reload(self, model: str) -> None:
        await self.action_stop()
        self.load(model)
