"""A stage's state as one buffer and back, in one process (the moves themselves: test_torch_s3)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")

from greyhound.integrations.torch_state import StageState, pack, unpack  # noqa: E402


def _stage(seed: int) -> StageState:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return StageState(module, opt, {"scheduler": sched})


def _train(s: StageState, steps: int) -> None:
    assert s.optimizer is not None
    for i in range(steps):
        s.module(torch.full((4, 3), float(i + 1))).square().sum().backward()
        s.optimizer.step()
        s.optimizer.zero_grad()
        s.extras["scheduler"].step()


def test_module_optimizer_and_extras_travel_as_one_buffer_and_train_on_identically() -> None:
    src = _stage(0)
    _train(src, 3)
    meta, buf = pack(src.state_dict(), torch.device("cpu"))
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    dst = _stage(1)  # another stage's initial weights: everything must be overwritten
    dst.load_state_dict(unpack(meta, buf, torch.device("cpu")))
    del buf  # the loaded state owns its memory
    _train(src, 2)
    _train(dst, 2)
    for a, b in zip(src.module.state_dict().values(), dst.module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert dst.extras["scheduler"].last_epoch == src.extras["scheduler"].last_epoch == 5
    assert dst.optimizer is not None and src.optimizer is not None
    assert dst.optimizer.param_groups[0]["lr"] == src.optimizer.param_groups[0]["lr"]


def test_dtypes_shapes_and_where_each_tensor_lived_survive() -> None:
    tree = {"f16": torch.arange(5, dtype=torch.float16), "i64": torch.tensor(7),
            "bf": torch.ones(2, 3, dtype=torch.bfloat16), "empty": torch.zeros(0, 4),
            "flag": torch.tensor([True, False]), "n": 3, "nested": [(torch.eye(2), "x")]}
    got = unpack(*pack(tree, torch.device("cpu")), torch.device("cpu"))
    for k in ("f16", "i64", "bf", "empty", "flag"):
        assert got[k].dtype == tree[k].dtype and torch.equal(got[k], tree[k])
    assert got["n"] == 3 and torch.equal(got["nested"][0][0], torch.eye(2))
    assert isinstance(got["nested"][0], tuple) and got["nested"][0][1] == "x"


def test_a_state_that_does_not_fit_the_stage_is_refused() -> None:
    src, other = _stage(0), StageState(torch.nn.Linear(3, 4))
    tree = unpack(*pack(src.state_dict(), torch.device("cpu")), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="state_dict"):
        other.load_state_dict(tree)
    no_opt = StageState(_stage(2).module)
    with pytest.raises(ValueError, match="optimizer"):
        no_opt.load_state_dict(tree)
