"""`moechat fit MODEL`: will this model run here, with what settings, and how fast, in numbers.

MODEL is a local model directory (complete weights: exact sizes from the safetensors headers; only config.json,
perhaps with the index: estimates from the config), or a Hub repo id: its downloaded snapshot, else config.json and
the safetensors headers read from the Hub (a ranged read per shard, no weights; with HF_HUB_OFFLINE, the config.json
in the local cache). `--vram-gb`, `--ram-gb`, `--disk-gb`, `--link-gbs`, `--ram-bw-gbs`, `--cores`, the presets
`--gpu`, `--ram` and `--link` (engine/plan/hardware, each figure with its source) and `--context` ask "what if"
without that hardware; every rate the plan uses is printed with where it comes from ("measured on this machine", a
preset's spec sheet, given, assumed), and a what-if machine never gets this machine's RAM read rate. The decode it
predicts is the `--on-miss` mode `run` will use (auto unless asked). The disk check is on the Hugging Face cache,
where `moechat pull` downloads (or a repack cache for a downloaded model), or `--disk-gb`. The first line ends in
exactly one of "runs", "runs with ..." (the flags, or the free RAM, it needs) and "cannot run: <why>" (a shortfall
with the cheapest fix, or what the loader cannot read); the exit status follows it: 0, 0, 3 (0 with --force when
only the plan refuses), and 1 on an error such as a missing config. It plans on the machine's total RAM and says
what is free now.

Start-up imports neither torch nor the engine; a config-only directory is planned without torch at all. "cannot run"
also comes from the loader's own checks (engine/load/loader.py `check_model`, headers and shapes only) over a
folder's weights or a Hub repo's fetched headers: what `run` refuses, fit refuses in the same words.

Parts (imports point down this list; the package re-exports what code outside it imports):
  command.py       the `fit` subcommand: its flags, `run_fit` (probe, plan every format, print) and the JSON
  report.py        the text report and the first line's verdict with its exit status (`headline`)
  run_defaults.py  `plan_for_run` / `cache_defaults`: the plan `moechat run` and the app take their cache sizes from
  gather.py        the model and the machine: the spec and the loader's refusal (folder or Hub), the disk the check
                   is on, the measured and given rates with their sources, the plans beside the chosen one
"""

from .command import add_fit_parser, run_fit
from .gather import least_free_ram, machine_rates, repack_dir, repacked_formats
from .report import EXIT_REFUSED, headline
from .run_defaults import cache_defaults, plan_for_run

__all__ = ["EXIT_REFUSED", "add_fit_parser", "cache_defaults", "headline", "least_free_ram", "machine_rates",
           "plan_for_run", "repack_dir", "repacked_formats", "run_fit"]
