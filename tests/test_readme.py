"""README's commands, in the order README gives them, on a fresh copy of its configs, as a new user runs
them: every `meshtron ...` command of its bash blocks (install chains reduced to their meshtron part),
cut to a few steps of a small model; and the config error it shows, compared line by line with what
the command prints. A README edit that breaks the workflow (a renamed key, a command that needs a file
an earlier one no longer writes) fails here."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# A few steps of a small model: the layouts, configs and data stay the README's.
CUT_TRAIN = ["--training.steps=2", "--training.seq_len=32", "--run.log_every=1", "--training.eval_every=0"]
CUT_MODEL = ["--model.n_layers=2"]  # not with model.init_from: the checkpoint fixes the architecture


def readme_commands() -> list[list[str]]:
    """Each `meshtron ...` command of README's bash blocks, in order: continuation lines joined,
    comments dropped, and of an install chain (`a && b && meshtron ...`) its meshtron part."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["meshtron"]:
                    commands.append(words)
    return commands


def shown_error() -> tuple[list[str], list[str]]:
    """README's example of a refused config: the command and the lines it prints."""
    block = re.search(r"```text\n\$ (meshtron .*?)\n(.*?)```", README, flags=re.S)
    assert block, "README shows a refused config in a ```text block starting with `$ meshtron`"
    return shlex.split(block.group(1)), block.group(2).rstrip("\n").splitlines()


def run(words: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", *words], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def fine_tuning_inputs(where: Path) -> None:
    """What README's fine-tuning commands expect the user to have: `my_texts/` and the checkpoint
    directory its config names (a tiny Llama in the Hugging Face format, with a tokenizer.json)."""
    transformers = pytest.importorskip("transformers")
    from meshtron.data.tokenizer import train_bpe

    texts = where / "my_texts"
    texts.mkdir()
    for i, source in enumerate(sorted((ROOT / "src" / "meshtron" / "data").glob("*.py"))):
        shutil.copy(source, texts / f"{i}.txt")
    checkpoint = where / "checkpoints" / "SmolLM2-135M"
    checkpoint.mkdir(parents=True)
    train_bpe(sorted(texts.iterdir()), 300, checkpoint / "tokenizer.json")
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(checkpoint)


def cut(words: list[str]) -> list[str]:
    """The README command shortened: a train runs a few steps of a smaller model."""
    if words[1] != "train":
        return words
    config = words[words.index("--config") + 1] if "--config" in words else ""
    return [*words, *CUT_TRAIN, *([] if "finetune" in config else CUT_MODEL)]


def test_readme_commands_run_in_order(tmp_path):
    commands = readme_commands()
    assert [" ".join(c[:2]) for c in commands][:1] == ["meshtron train"], "README starts with the demo"
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    fine_tuning_inputs(tmp_path)
    for words in commands:
        out = run(cut(words), tmp_path)
        shown = " ".join(words)
        assert out.returncode == 0, f"README's `{shown}` failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        assert "Traceback" not in out.stderr, f"`{shown}`:\n{out.stderr[-3000:]}"
    # What the workflow left for the next user step (README names these files).
    assert (tmp_path / "runs" / "demo" / "loss.png").exists()
    assert (tmp_path / "runs" / "demo" / "hf" / "config.json").exists()


def test_readme_shows_the_config_error_the_command_prints(tmp_path):
    words, shown = shown_error()
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    out = run(words, tmp_path, timeout=120)
    assert out.returncode != 0
    assert out.stderr.rstrip("\n").splitlines() == shown
