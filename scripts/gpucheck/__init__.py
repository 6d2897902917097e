"""The parts of scripts/gpu_check.py (the GPU readiness check, `scripts/gpu-check`); see that
file's docstring. Importable with scripts/ on sys.path, as `python scripts/gpu_check.py`
has it; importing it imports nothing of lbcomm."""
