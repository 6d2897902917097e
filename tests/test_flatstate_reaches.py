"""scripts/reaches.py, the count of reaches into other objects' private attributes, and
the guard that lbcomm.optim has none (its pieces take the `FlatState` instead)."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "reaches.py")


def _run(*args):
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, check=True, cwd=ROOT)
    return out.stdout


def test_counts_reaches_and_not_own_or_module_attributes(tmp_path):
    src = tmp_path / "sample.py"
    src.write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn
        from . import functional as F
        from .base import Base

        class A(Base):
            def f(self, other):
                self._own = 1                     # own: not counted
                super()._hook()                   # own: not counted
                A._table                          # its own class: not counted
                torch._C, nn._reduction, F._x     # modules: not counted
                other._flat["m"]                  # counted
                self.opt._vectors                 # counted: another object's
                return Base._private, other.__dict__, other.public  # counted once (Base is a class)
        """))
    out = _run(str(src), "--list")
    sites = [line.split(": ", 1)[1] for line in out.splitlines() if line.strip().startswith(str(src))]
    assert sites == ['other._flat', 'self.opt._vectors', 'Base._private']
    assert out.splitlines()[-1].split() == ["3", "total"]


def test_lbcomm_optim_reaches_into_no_private_attributes():
    out = _run("lbcomm/optim", "--list")
    assert out.splitlines()[-1].split() == ["0", "total"], out
