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
from textual.widgets import Footer, Header

from ..bridge import EngineBridge, policy_names, prefetch_modes
from ..livestats import RefreshGovernor, fmt_rate
from ..messages import (
    CacheRetuned,
    EngineFailed,
    EngineReady,
    GenerationFailed,
    GenerationFinished,
    HitCurveReady,
    LoadProgress,
    ModelInfo,
    RetuneFailed,
    StatsUpdated,
    TokensArrived,
)
from ..session import ChatSession
from ..store import export_file
from ..widgets.dashboard import Dashboard
from ..widgets.loading import LoadingPanel
from ..widgets.prompt import PromptInput
from ..widgets.transcript import AssistantMessage, Transcript
from ..widgets.tuning import NATIVE_NAMES, TuningPanel
from .chats import ChatsScreen
from .dialogs import FormatScreen, OpenModelScreen, SamplingScreen, SystemPromptScreen, format_change_text

# The panel redraws at most 4 times a second, whatever the governor says: a redraw repaints only the labels,
# sparkline and heatmap rows that changed (~1-2 ms of the UI thread), and bench/tui_overhead.py measures it
# against the hidden panel on the real engine.
STATS_MIN_INTERVAL_S = 0.25


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "stop", "Stop", show=True),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+o", "open_chats", "Chats"),
        Binding("ctrl+s", "export", "Export"),
        Binding("f2", "system_prompt", "System"),
        Binding("f3", "sampling", "Sampling"),
        Binding("f4", "toggle_dashboard", "Panel"),
        Binding("ctrl+l", "open_model", "Open model", show=False),
        Binding("f5", "setup", "Get models"),
    ]
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-normal"), (170, "-wide")]

    def __init__(self, model: str):
        super().__init__()
        self.model = model
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
        yield Header(icon="◆")
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield LoadingPanel(id="loading")
                yield Transcript(id="transcript")
                yield PromptInput(id="prompt")
            yield Dashboard(policy_names(), memory_probe=self.app.memory_probe, prefetch_modes=prefetch_modes(),
                            id="dashboard")
        yield Footer()
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
        self.dashboard.display = self.app.settings.show_dashboard
        self.query_one(PromptInput).focus()
        self.load(self.model)

    def on_unmount(self) -> None:
        self.bridge.stop()

    def load(self, model: str) -> None:
        self.model = model
        self.info = None
        self.query_one(LoadingPanel).show_stage(Path(model).name, "starting", 0.0)
        self.dashboard.show_model(None, loading=f"loading {Path(model).name}…")
        self.bridge.load(model, expert_format=self.app.expert_format(model))

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
        self.dashboard.show_model(info)
        settings = self.app.settings
        settings.remember_model(info.path)
        problem = settings.save()
        if problem:
            self.notify(problem, severity="warning")
        if not info.has_chat_template:
            self.notify("This model has no chat template, so it cannot chat here; `moechat run --raw` completes "
                        "plain text.", severity="warning", timeout=12)

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.sub_title = f"{Path(self.model).name} · not loaded"
        self.query_one(LoadingPanel).show_error(Path(self.model).name, message.error)
        self.dashboard.show_model(None, loading="no model loaded")
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
        footer = f"{message.generated_tokens} tokens · {fmt_rate(message.decode_tps)} tok/s"
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
        if self._stats_pending and self.dashboard.display and self.last_stats is not None:
            self._stats_pending = False
            self.dashboard.show_stats(self.last_stats)

    def on_hit_curve_ready(self, message: HitCurveReady) -> None:
        self.query_one(TuningPanel).show_curve(message.curve)

    def on_cache_retuned(self, message: CacheRetuned) -> None:
        self.query_one(TuningPanel).show_state(message.state)
        when = f" at token {message.at_token}" if message.at_token is not None else ""
        self.notify(f"expert cache retuned{when}: {message.state.slots} slots, {message.state.policy}", timeout=3)

    def on_retune_failed(self, message: RetuneFailed) -> None:
        self.notify(message.error, title="Cache not changed", severity="error", timeout=8)
        if self.info is not None:
            self.query_one(TuningPanel).show_state(self.query_one(TuningPanel).state)

    def on_tuning_panel_changed(self, message: TuningPanel.Changed) -> None:
        if self.info is None:
            return
        self.bridge.retune(expert_slots=message.expert_slots, policy=message.policy,
                           ram_cache_bytes=message.ram_cache_bytes, prefetch=message.prefetch)

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
        if self.info is None:
            self.notify("The model is not loaded yet; your message is kept in the prompt.", severity="warning")
            return
        if self.gen_id is not None:
            self.notify("Still replying: press Escape to stop it first.", severity="warning")
            return
        event.prompt.remember(event.text)
        event.prompt.clear()
        self.session.add_user(event.text)
        await self.transcript.add_user(event.text)
        await self._start_reply()

    async def _start_reply(self) -> None:
        request = self.session.request()
        if request is None:
            return
        history, text = request
        self.session.start_reply()
        self.reply = await self.transcript.add_assistant()
        self.transcript.scroll_end(animate=False)
        settings = self.app.settings
        self.gen_id = self.bridge.generate(history, text, settings.sampling, settings.max_tokens,
                                           self.template_kwargs())

    def template_kwargs(self) -> dict:
        """Chat template variables for the next reply: the reasoning effort, when the template reads one.

        Unset (no --reasoning-effort, none chosen in the sampling dialog), nothing is passed and the
        template's own default applies (gpt-oss: "medium")."""
        effort = self.app.reasoning_effort or self.app.settings.reasoning_effort
        if effort and self.info is not None and self.info.reads_reasoning_effort:
            return {"reasoning_effort": effort}
        return {}

    async def _end_reply(self, status: str, footer: str = "", stats: dict | None = None) -> None:
        if self._flush_timer is not None:
            self._flush_timer.stop()
        await self.flush_reply()
        self.gen_id = None
        self.session.finish_reply(status, stats)
        reply, self.reply = self.reply, None
        if reply is not None:
            await reply.finish(status, footer, error=footer if status == "error" else "")

    async def action_stop(self) -> None:
        if self.gen_id is None:
            return
        self.bridge.stop()
        await self._end_reply("stopped")

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
                footer = (f"{stats['generated_tokens']} tokens · {fmt_rate(stats['decode_tps'])} tok/s"
                          if "generated_tokens" in stats else "")
                await transcript.add_assistant(turn.content, turn.status, footer, turn.thinking)
        transcript.scroll_end(animate=False)
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

        self.app.push_screen(ChatsScreen(self.app.store), done)

    def action_export(self) -> None:
        if self.session.conversation_id is None:
            self.notify("Nothing to export yet.", severity="warning")
            return
        self._export(self.session.conversation_id)

    def _export(self, conversation_id: int) -> None:
        try:
            path = export_file(self.app.store, conversation_id, self.app.export_dir)
        except OSError as e:
            self.notify(f"Export failed: {e.strerror or e}", severity="error")
            return
        self.notify(f"Exported to {path}", title="Export", timeout=6)

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
            if info.reads_reasoning_effort:
                settings.reasoning_effort = result.reasoning_effort
                self.app.reasoning_effort = None  # the choice made here replaces --reasoning-effort's
            settings.save()

        effort = self.app.reasoning_effort or settings.reasoning_effort
        dialog = SamplingScreen(info.sampling_defaults, info.generation_config, settings.sampling, settings.max_tokens,
                                info.default_max_tokens, reasoning_effort=effort,
                                reads_reasoning_effort=info.reads_reasoning_effort)
        self.app.push_screen(dialog, done)

    def action_toggle_dashboard(self) -> None:
        dashboard = self.dashboard
        dashboard.display = not dashboard.display
        self.app.settings.show_dashboard = dashboard.display
        self.app.settings.save()
        if dashboard.display and self.last_stats is not None:
            self._stats_pending = False
            dashboard.show_stats(self.last_stats)

    def action_open_model(self) -> None:
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
