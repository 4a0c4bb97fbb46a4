"""Data mixtures (issue 32.3): several prepared sources drawn by weight in one deterministic interleave that
holds every source within one sample of its share at every step, never depends on the layout, resumes
on another layout, and reports each source's tokens per step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshtron.commands.export import checkpoint_tokenizer
from meshtron.config.schema import ConfigError
from meshtron.data import DataError
from meshtron.data.dataset import PreparedData, prepare_data
from meshtron.data.mixture import Mixture, MixtureSampler
from meshtron.data.tokenizer import TOKENIZER_FILE
from meshtron.rules.checks import check, load_config
from meshtron.testing.parity import assert_losses_match, train_rows, trainer_for
from meshtron.testing.tiny import TINY
from meshtron.train.sample import PROMPT_TOKENS
from meshtron.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = (0.5, 0.3, 0.2)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    """Three byte-tokenized datasets of different text (the package's data, parallel and plan code)."""
    tmp = tmp_path_factory.mktemp("mixture")
    out = []
    for name in ("data", "parallel", "plan"):
        out.append(tmp / name)
        prepare_data([ROOT / "src" / "meshtron" / name], out[-1], tokenizer="byte")
    return out


def mixture_overrides(paths: list[Path], weights=WEIGHTS) -> list[str]:
    tables = ", ".join(f'{{path = "{p}", weight = {w}}}' for p, w in zip(paths, weights, strict=True))
    return [f"--data.sources=[{tables}]"]


def test_every_source_keeps_its_share_at_every_step(sources):
    mixture = Mixture.open([str(p) for p in sources], [5, 3, 2])  # normalised to 0.5, 0.3, 0.2
    sampler = MixtureSampler(mixture, seq_len=32, global_batch=10, seed=0)
    taken = np.zeros(3)
    seen: list[set] = [set(), set(), set()]
    for step in range(60):
        chosen, windows = sampler.samples(step)
        taken += np.bincount(chosen, minlength=3)
        assert np.all(np.abs(taken - np.array(WEIGHTS) * 10 * (step + 1)) < 1), (step, taken)
        for j, w in zip(chosen, windows, strict=True):
            if len(seen[j]) < sampler.n_windows[j]:  # within a source's first epoch: no window twice
                assert w not in seen[j]
                seen[j].add(int(w))
    again = MixtureSampler(mixture, seq_len=32, global_batch=10, seed=0)
    assert [again.samples(s)[1].tolist() for s in (7, 3)] == [sampler.samples(s)[1].tolist() for s in (7, 3)]


def test_a_mixture_trains_the_same_in_every_layout_and_resumes_on_another(workers, sources, tmp_path):
    base = [*TINY, *mixture_overrides(sources), "--training.steps=4", "--run.sample_tokens=0"]
    one = workers(1).run(train_rows, [*base, "--training.micro_batch=8"])[0]
    assert [sum(r["tokens_by_source"].values()) for r in one] == [8 * 32] * 4
    assert {k for r in one for k in r["tokens_by_source"]} == {"data", "parallel", "plan"}
    for row in one:  # the loss per source: each source's mean; weighted by its tokens, the step's loss
        tokens, losses = row["tokens_by_source"], row["loss_by_source"]
        assert abs(sum(losses[n] * tokens[n] for n in losses) / (8 * 32) - row["loss"]) <= 1e-5 * row["loss"]
    for world, layout in [
        (2, ["--parallel.dp_shard=2", "--training.micro_batch=2"]),
        (2, ["--parallel.pp=2", "--training.micro_batch=2"]),
    ]:
        rows = workers(world).run(train_rows, [*base, *layout])[0]
        assert_losses_match(rows, one)
        for row, want in zip(rows, one, strict=True):
            for name, loss in want["loss_by_source"].items():
                assert abs(row["loss_by_source"][name] - loss) <= 1e-5 * loss, (name, row, want)
    # Two steps on one device with a checkpoint, then resumed under dp 2 x pp 2 to step 4.
    ck = [f"--checkpoint.dir={tmp_path / 'ck'}", "--checkpoint.every=2"]
    workers(1).run(train_rows, [*base, *ck, "--training.steps=2", "--training.micro_batch=8"])
    resumed = [*base, *ck, "--checkpoint.resume=true", "--parallel.dp_shard=2", "--parallel.pp=2"]
    rows = workers(4).run(train_rows, [*resumed, "--training.micro_batch=1"])[0]
    assert [r["step"] for r in rows] == [3, 4]
    assert_losses_match(rows, one[2:])


def validation_rows(overrides: list[str]) -> list[dict]:
    trainer = trainer_for(overrides)
    return [trainer.step(0), trainer.evaluator.evaluate(1)]


def test_validation_holds_out_each_sources_tail_and_reports_each(workers, sources):
    val = [*TINY, *mixture_overrides(sources), "--data.val_fraction=0.2", "--training.eval_batches=2"]
    one = workers(1).run(validation_rows, [*val, "--training.micro_batch=8"])[0]
    layout = ["--parallel.dp_shard=2", "--parallel.pp=2", "--training.micro_batch=2"]
    four = workers(4).run(validation_rows, [*val, *layout])[0]
    assert set(one[1]["val_loss_by_source"]) == {"data", "parallel", "plan"}
    for got, want in zip(four, one, strict=True):
        for key in ("loss", "val_loss"):
            if key in want:
                assert abs(got[key] - want[key]) <= 1e-5 * want[key]
    for name, loss in one[1]["val_loss_by_source"].items():
        assert abs(four[1]["val_loss_by_source"][name] - loss) <= 1e-5 * loss


def test_mixture_input_errors_say_what_to_fix(sources, tmp_path):
    def problems(overrides: list[str]) -> str:
        with pytest.raises(ConfigError) as err:
            check(load_config(None, [*TINY, *overrides]), 1)
        return str(err.value)

    assert "must be positive" in problems(mixture_overrides(sources, (1, 0, 1)))
    assert "keep one: remove data.path (--data.path= on the command line unsets it)" in problems(
        [*mixture_overrides(sources), f"--data.path={sources[0]}"]
    )
    assert "names a path twice" in problems(mixture_overrides([sources[0], sources[0], sources[1]]))
    other = tmp_path / "other"
    prepare_data([ROOT / "src" / "meshtron" / "data"], other, tokenizer="bpe", vocab_size=300)
    with pytest.raises(DataError, match="another tokenizer"):
        Mixture.open([str(sources[0]), str(other)], [1, 1])
    assert json.loads((other / "meta.json").read_text())["tokenizer"] == "tokenizer.json"


def test_a_mixture_runs_to_its_end_with_the_defaults(sources, tmp_path, capsys):
    """The end of a run reads its data too: the closing sample (its prompt the first source's first
    tokens), the pictures, the summary; an export finds the tokenizer of a checkpoint without one."""
    run = [
        *TINY,
        *mixture_overrides(sources),
        "--training.steps=2",
        "--run.plot=true",
        f"--run.dir={tmp_path}",
    ]
    cfg = load_config(None, [*run, "--checkpoint.every=2"])
    assert cfg.run.sample_tokens > 0  # the default: a sample at the end
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    first = PreparedData.open(sources[0])
    prompt = first.load_tokenizer().decode([int(t) for t in first.tokens[:PROMPT_TOKENS]])
    assert f"tokens after the data's first {PROMPT_TOKENS}): {prompt!r} -> " in capsys.readouterr().out
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    assert (tmp_path / "loss.png").is_file()
    step_dir = tmp_path / "checkpoints" / "step-00000002"
    (step_dir / TOKENIZER_FILE).unlink()  # as an older checkpoint: the run's data names the tokenizer
    assert checkpoint_tokenizer(step_dir, cfg).vocab_size == first.vocab_size


def test_the_command_line_chooses_the_data_over_the_config_file(sources, tmp_path):
    """docs/data.md's `--data.sources=[...]` replaces a config file's data.path (and the file's
    validation data likewise); an empty data.path is no path; both in one place are refused."""
    paths = [str(p) for p in sources]
    with_path = tmp_path / "path.toml"
    with_path.write_text(f'[data]\npath = "{paths[0]}"\nval_fraction = 0.1\n')
    cfg = check(load_config(with_path, [*TINY, *mixture_overrides(sources)]), 1)
    assert (cfg.data.path, [s.path for s in cfg.data.sources], cfg.data.val_fraction) == (
        "default",
        paths,
        0.1,
    )
    for unset in ("--data.path=", "--data.path=default"):
        assert load_config(with_path, [*TINY, *mixture_overrides(sources), unset]).data == cfg.data
    assert load_config(None, ["--data.path="]).data.path == "default"  # no path: the default corpus
    with_sources = tmp_path / "sources.toml"
    with_sources.write_text(
        f'[data]\nval_fraction = 0.1\n[[data.sources]]\npath = "{paths[0]}"\nweight = 1\n'
    )
    cfg = check(
        load_config(with_sources, [*TINY, f"--data.path={paths[1]}", f"--data.val_path={paths[2]}"]), 1
    )
    assert (cfg.data.path, cfg.data.sources, cfg.data.val_path, cfg.data.val_fraction) == (
        paths[1], [], paths[2], 0.0,
    )  # fmt: skip
    assert load_config(with_sources, ["--data.val_fraction=0", "--data.path="]).data.sources  # nothing chosen
    both = tmp_path / "both.toml"
    both.write_text(f'[data]\npath = "{paths[1]}"\n' + with_sources.read_text().split("\n", 1)[1])
    with pytest.raises(ConfigError, match="--data.path= on the command line unsets it"):
        check(load_config(both, TINY), 1)
    assert check(load_config(both, [*TINY, "--data.path="]), 1).data.sources  # the advice works
