"""Issue 45.13: what a run's start-up imports. torch.compiler.disable imports torch._dynamo (with sympy,
FSDP and DTensor: seconds on a busy 2-core machine) where it decorates; a run that never compiles must
not pay for it."""

from __future__ import annotations

import subprocess
import sys


def test_the_training_modules_load_without_the_compiler():
    modules = "meshtron.commands.train, meshtron.train.setup, meshtron.train.trainer, meshtron.models.moe"
    code = f"import sys, {modules}; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
