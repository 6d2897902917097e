"""CommConfig is what every communicating object takes: CompressionState, WarmupAverage,
save_sharded and load_sharded accept ``comm=`` beside their 0.2 keyword arguments, and
refuse both at once."""
import pytest
import torch

import lbcomm
from lbcomm import CommConfig


def test_compression_state_takes_its_settings_from_comm():
    st = lbcomm.CompressionState(1000, comm=CommConfig(block_size=256, nonfinite="skip"))
    assert st.block_size == 256 and st.nonfinite == "skip"
    default = lbcomm.CompressionState(1000)  # 0.2 defaults unchanged
    assert default.block_size == 2048 and default.nonfinite == "raise"
    assert lbcomm.CompressionState(1000, comm=CommConfig()).nonfinite == "skip"  # CommConfig's default


@pytest.mark.parametrize("kwargs", [dict(block_size=256), dict(nonfinite="skip"), dict(backend="torch")])
def test_compression_state_refuses_settings_beside_comm(kwargs):
    with pytest.raises(TypeError, match="in comm"):
        lbcomm.CompressionState(1000, comm=CommConfig(), **kwargs)


def test_comm_must_be_a_commconfig():
    with pytest.raises(TypeError, match="CommConfig"):
        lbcomm.CompressionState(1000, comm={"block_size": 256})


def test_warmup_average_and_checkpoints_take_comm(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=10)
    assert lbcomm.WarmupAverage(opt, comm=CommConfig()).process_group is None
    with pytest.raises(TypeError, match="process_group in comm"):
        lbcomm.WarmupAverage(opt, process_group=object(), comm=CommConfig())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = lbcomm.save_sharded(str(tmp_path), opt, model, extra={"step": 1}, comm=CommConfig())
    assert path.endswith(".pt")
    info = lbcomm.load_sharded(str(tmp_path), opt, model, comm=CommConfig())
    assert info["extra"] == {"step": 1} and info["exact"]
    with pytest.raises(TypeError, match="backend in comm"):
        lbcomm.load_sharded(str(tmp_path), opt, model, backend="torch", comm=CommConfig())
