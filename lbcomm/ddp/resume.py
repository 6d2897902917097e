"""A resume that restores the model and the optimizer but not a hook's error feedback.

A hook state (`OneBitHookState`, `OneBitHSDPState`) that was not restored starts its
full-precision start and its error feedback from zero: a resumed run then silently ends
with other weights than the run it continues. `ResumeCheck` notices it at the hook's first
call: the optimizer the hook feeds (``state.check_resume(optimizer)``) already holds state
from earlier steps while the hook state was never loaded (nor has run before).
"""
import warnings
from typing import Optional
from ..errors import MissingHookStateWarning

__all__ = ["ResumeCheck", "MissingHookStateWarning"]


class ResumeCheck:
    """Whether a hook state was loaded, and the optimizer to compare with at its first call."""

    __slots__ = ("optimizer", "loaded", "done")

    def __init__(self):
        self.optimizer = None
        self.loaded = False
        self.done = False

    def watch(self, optimizer) -> None:
        if not (hasattr(optimizer, "state") and hasattr(optimizer, "state_dict")):
            raise TypeError(f"check_resume: expected the optimizer the hook's gradients feed, got "
                            f"{type(optimizer).__name__}")
        self.optimizer = optimizer

    def check(self, who: str, state_name: str, fresh: bool) -> Optional[str]:
        """At a hook call: once, warn when the watched optimizer holds state while the hook
        state is `fresh` (never ran) and was not loaded; returns the message, or None."""
        if self.done:
            return None
        self.done = True
        opt, self.optimizer = self.optimizer, None
        if opt is None or self.loaded or not fresh or not len(opt.state):
            return None
        msg = (f"{who}: the optimizer holds state from earlier steps (restored from a checkpoint?) but this "
               f"{state_name} was not restored: its error feedback and iteration count start from zero, so the run "
               f"does not continue as the checkpointed one would. Save and load the {state_name} with the model and "
               f"optimizer: lbcomm.save_sharded / lbcomm.load_sharded(..., hook_state=state), or "
               f"lbcomm.integrations.dcp.RankLocal(state) in the torch.distributed.checkpoint state dict")
        warnings.warn(msg, MissingHookStateWarning, stacklevel=3)
        return msg
