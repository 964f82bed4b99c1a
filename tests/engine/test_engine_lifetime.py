"""An engine that closes lets its weights go: loading and closing the same model again and again (the app's reload,
`moechat serve` restarts in one process, a test session) holds one model's tensors at most, not one per load."""

from __future__ import annotations

import gc
import warnings

import torch


def _live_tensor_bytes() -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.distributed's deprecated aliases warn on isinstance
        objs = gc.get_objects()
    seen, total = set(), 0
    for o in objs:
        if type(o) not in (torch.Tensor, torch.nn.Parameter) or o.is_meta:
            continue  # FakeTensors and other subclasses an earlier torch.compile test left have no storage to count
        try:
            storage = o.untyped_storage()
            ptr = storage.data_ptr()
        except RuntimeError:
            continue
        if ptr not in seen:
            seen.add(ptr)
            total += storage.nbytes()
    return total


def test_load_and_close_again_and_again_holds_no_old_model(tiny_models):
    from moechat.engine.runtime.generate import Engine

    path, _ = tiny_models["qwen3_moe"]

    def cycle():
        engine = Engine.load(path, dtype="float32")
        list(engine.generate([3, 4, 5, 6], max_tokens=3, stop_on_eos=False))
        engine.close()
        del engine
        gc.collect()

    cycle()
    after_one = _live_tensor_bytes()
    for _ in range(3):
        cycle()
    grown = _live_tensor_bytes() - after_one
    assert grown < 64 * 1024, f"{grown:,} bytes of tensors outlived three closed engines"
