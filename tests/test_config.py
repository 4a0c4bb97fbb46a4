"""Config loading, overrides, presets and every validation error (each names its fix)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from meshtron.config.loading import load_toml, model_preset, parse_override
from meshtron.config.schema import Config, ConfigError
from meshtron.rules.checks import check, load_config, validate

DEEPSEEK = ["--model.name=tiny-deepseek"]


def test_defaults_are_valid():
    assert validate(Config(), 1) == []


def test_toml_file_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "tiny"\nn_layers = 3\n[training]\nsteps = 7\ndtype = "bf16"\n')
    cfg = load_config(path, ["--training.steps=9", "--parallel.sp=true", "--run.dir=/tmp/x y"])
    assert cfg.model.dim == 64  # from the preset
    assert cfg.model.n_layers == 3  # explicit key beats the preset
    assert cfg.training.steps == 9  # override beats the file
    assert cfg.training.dtype == "bf16"
    assert cfg.parallel.sp is True
    assert cfg.run.dir == "/tmp/x y"


def test_parse_override_reads_toml_literals():
    assert parse_override("--training.lr=3e-4") == ("training", "lr", 3e-4)
    assert parse_override("--model.dense_layers=[0, 2]") == ("model", "dense_layers", [0, 2])
    assert parse_override("--training.dtype=bf16") == ("training", "dtype", "bf16")
    assert parse_override("--parallel.sp=false") == ("parallel", "sp", False)


def test_int_accepted_for_float_field():
    assert load_config(None, ["--training.lr=1"]).training.lr == 1.0


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["--model.dimm=3"], "unknown key model.dimm; did you mean 'dim'?"),
        (
            ["--trainig.steps=3"],
            "unknown section [trainig] in override '--trainig.steps=3'; did you mean 'training'?",
        ),
        (["--training.steps=ten"], "training.steps must be an integer, got 'ten'"),
        (["--training.lr=true"], "training.lr must be a number, got True"),
        (["--parallel.sp=1"], "parallel.sp must be true or false, got 1"),
        (["--model.dense_layers=3"], "model.dense_layers must be a list of int, got 3"),
        (["--model.name=llama9"], "model.name='llama9' is not a known preset"),
        (["--model.name=lama3-8b"], "did you mean 'llama3-8b'?"),
        (["training.steps"], "must look like --section.key=value"),
    ],
)
def test_build_errors(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expected in str(err.value)


def test_build_errors_are_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--model.dimm=3", "--training.steps=x", "--nope.a=1"])
    assert len(err.value.problems) == 3


def test_missing_file_and_malformed_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\ndim = 64\nn_layers = = 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "not valid TOML" in str(err.value) and "line 3" in str(err.value)


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        (["--model.dim=0"], 1, "model.dim=0 must be positive"),
        (["--training.micro_batch=-2"], 1, "training.micro_batch=-2 must be positive"),
        (["--parallel.tp=0"], 1, "parallel.tp=0 must be positive"),
        (["--parallel.dp_shard=0"], 1, "parallel.dp_shard=0 must be positive, or -1"),
        (["--model.n_experts=-1"], 1, "model.n_experts=-1 must be >= 0"),
        (["--parallel.zero=4"], 1, "parallel.zero=4 is not one of 1, 2, 3"),
        (["--training.min_lr_ratio=2.0"], 1, "training.min_lr_ratio=2.0 must be between 0 and 1"),
        (["--training.dtype=fp16"], 1, "training.dtype='fp16' is not one of fp32, bf16"),
        (
            ["--training.recompute=some"],
            1,
            "training.recompute='some' is not one of none, selective, op, full",
        ),
        (["--parallel.pp_schedule=1f1f"], 1, "did you mean '1f1b'?"),
        (
            ["--parallel.cp_impl=ulysses"],
            1,
            "parallel.cp_impl='ulysses' is not one of ring, allgather, alltoall, hybrid",
        ),
        (["--model.router=topk"], 1, "model.router='topk' is not one of softmax, sigmoid"),
        (["--model.rope_scaling=linear"], 1, "model.rope_scaling='linear' is not one of none, llama3, yarn"),
        (["--run.device=tpu"], 1, "run.device='tpu' is not one of auto, cpu, cuda"),
        (["--data.tokenizer=wordpiece"], 1, "data.tokenizer='wordpiece' is not one of bpe, byte"),
        (["--model.dim=100", "--model.n_heads=8"], 1, "model.dim=100 is not divisible by model.n_heads=8"),
        (["--model.dim=24", "--model.n_heads=8"], 1, "head size 3 must be even"),
        (
            ["--model.n_heads=8", "--model.n_kv_heads=3"],
            1,
            "model.n_heads=8 is not divisible by model.n_kv_heads=3; use n_kv_heads in [1, 2, 4, 8]",
        ),
        (
            ["--model.n_experts=4", "--model.top_k=5"],
            1,
            "model.top_k=5 must be between 1 and model.n_experts=4",
        ),
        (["--model.n_experts=4", "--model.dense_layers=[9]"], 1, "model.dense_layers [9] are outside 0..3"),
        (["--model.n_experts=4", "--model.shared_expert_gate=true"], 1, "needs model.n_shared_experts >= 1"),
        (["--model.rope_scaling=llama3", "--model.rope_high_freq_factor=0.5"], 1, "must exceed"),
        # DeepSeek-V3's architecture: latent attention, context parallel over its latents, routing, MTP
        (
            [*DEEPSEEK, "--model.qk_rope_head_dim=7"],
            1,
            "latent attention's rotary key needs an even, positive size",
        ),
        (
            [*DEEPSEEK, "--model.v_head_dim=0"],
            1,
            "model.v_head_dim=0 must be positive under latent attention",
        ),
        ([*DEEPSEEK, "--model.qk_norm=true"], 1, "do not apply to latent attention"),
        ([*DEEPSEEK, "--model.n_kv_heads=2"], 1, "leave n_kv_heads at 0"),
        # tensor parallel splits MLA's heads (the latents are replicated or sequence-parallel, any size)
        (
            [*DEEPSEEK, "--parallel.tp=3", "--training.global_batch=3"],
            3,
            "model.n_heads=4 is not divisible by parallel.tp=3",
        ),
        (
            [*DEEPSEEK, "--parallel.cp=2", "--parallel.cp_impl=alltoall", "--parallel.cp_exchange=latent"],
            2,
            "use cp_exchange='kv'",
        ),
        (["--parallel.cp=2", "--parallel.cp_exchange=latent"], 2, "no MLA (model.kv_lora_rank=0)"),
        ([*DEEPSEEK, "--model.n_expert_groups=3"], 1, "not divisible by model.n_expert_groups=3"),
        (
            [*DEEPSEEK, "--model.topk_expert_groups=5"],
            1,
            "model.topk_expert_groups=5 must be <= model.n_expert_groups=4",
        ),
        (
            [*DEEPSEEK, "--model.mtp_depth=32", "--training.seq_len=32"],
            1,
            "model.mtp_depth=32 leaves its last depth no target",
        ),
        (
            ["--parallel.tp=2"],
            3,
            "world size 3 is not divisible by tp=2 (dp_shard takes the rest); launch --nproc 2",
        ),
        (
            ["--parallel.dp_shard=2"],
            4,
            "multiply to dp_shard=2 but the world size is 4; launch --nproc 2, or set",
        ),
        (
            ["--model.n_heads=12", "--model.dim=96", "--parallel.tp=8"],
            8,
            "model.n_heads=12 is not divisible by parallel.tp=8; use tp in [1, 2, 3, 4, 6, 12]",
        ),
        (["--model.n_heads=8", "--model.n_kv_heads=4", "--parallel.tp=8", "--model.ffn_dim=96"], 8, None),
        (
            ["--model.n_heads=12", "--model.dim=96", "--model.n_kv_heads=4", "--parallel.tp=6"],
            6,
            "model.n_kv_heads=4 and parallel.tp=6: one must divide the other",
        ),
        (
            ["--model.ffn_dim=100", "--parallel.tp=8"],
            8,
            "model.ffn_dim=100 is not divisible by parallel.tp=8",
        ),
        (
            ["--model.n_experts=4", "--model.moe_ffn_dim=6", "--parallel.tp=4"],
            4,
            "expert ffn dim 6 is not divisible by parallel.tp=4",
        ),
        (["--parallel.sp=true"], 1, "parallel.sp=true needs parallel.tp > 1"),
        (
            [
                "--model.n_experts=4",
                "--model.moe_ffn_dim=8",
                "--model.n_shared_experts=1",
                "--model.shared_ffn_dim=6",
                "--parallel.tp=4",
            ],
            4,
            "shared expert ffn dim 6 is not divisible",
        ),
        (
            ["--parallel.sp=true", "--parallel.tp=2", "--training.seq_len=33"],
            2,
            "training.seq_len=33 must be divisible by tp*cp=2",
        ),
        (
            ["--parallel.cp=2", "--training.seq_len=34"],
            2,
            "training.seq_len=34 must be divisible by 4 for cp=2",
        ),
        (["--parallel.cp=2", "--parallel.tp=4", "--parallel.cp_impl=alltoall"], 8, None),
        (
            ["--parallel.cp=4", "--parallel.tp=4", "--parallel.cp_impl=alltoall"],
            16,
            "cp_impl='alltoall' splits the 2 query heads of a tp rank over 4 ranks",
        ),
        (["--parallel.pp=8", "--training.global_batch=64"], 8, "model.n_layers=4 cannot fill pp*vpp=8"),
        (["--parallel.vpp=2"], 1, "parallel.vpp=2 needs the interleaved schedule"),
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--training.global_batch=16"],
            2,
            "needs parallel.vpp >= 2",
        ),
        (
            ["--parallel.pp=2", "--parallel.pp_layers=[1, 2]", "--training.global_batch=16"],
            2,
            "parallel.pp_layers=[1, 2] must give pp*vpp=2 layer counts adding up to model.n_layers=4",
        ),
        (
            ["--parallel.pp=2", "--parallel.pp_layers=[1, 3]", "--parallel.pp_head_layers=1"],
            2,
            "set one or the other",
        ),
        (["--parallel.ep=2"], 2, "parallel.ep=2 needs an MoE model (model.n_experts > 0)"),
        (
            ["--model.n_experts=6", "--parallel.ep=4"],
            4,
            "model.n_experts=6 is not divisible by parallel.ep=4",
        ),
        (
            ["--model.n_experts=4", "--parallel.ep=4", "--parallel.tp=2", "--training.global_batch=16"],
            4,
            "parallel.ep=4 must divide dp_shard*cp=2",
        ),
        (
            ["--training.global_batch=12", "--training.micro_batch=4"],
            2,
            "training.global_batch=12 is not divisible by micro_batch*dp = 4*2",
        ),
        (
            ["--parallel.pp=4", "--training.global_batch=8", "--training.micro_batch=4"],
            4,
            "2 micro-batch(es) per step cannot fill pp=4 stages",
        ),
        (
            [
                "--parallel.pp=2",
                "--parallel.vpp=2",
                "--parallel.pp_schedule=interleaved",
                "--training.global_batch=24",
                "--training.micro_batch=8",
            ],
            2,
            "interleaved 1F1B needs micro-batches per step (3) to be a multiple of pp=2",
        ),
    ],
)
def test_validation_errors(overrides, world, expected):
    problems = validate(load_config(None, overrides), world)
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems


def test_all_problems_reported_at_once():
    cfg = load_config(
        None,
        [
            "--model.n_heads=12",
            "--model.dim=96",
            "--parallel.tp=8",
            "--parallel.ep=2",
            "--training.dtype=bf17",
        ],
    )
    with pytest.raises(ConfigError) as err:
        check(cfg, 8)
    text = str(err.value)
    assert len(err.value.problems) == 3
    assert "did you mean 'bf16'" in text and "use tp in" in text and "needs an MoE model" in text


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        # A batch that does not split still leaves the split's and the schedule's own rules to report.
        (
            [
                "--parallel.pp=2",
                "--parallel.pp_layers=[1, 1, 1]",
                "--parallel.vpp=2",
                "--training.global_batch=3",
            ],
            2,
            ["must give pp*vpp=4 layer counts", "needs the interleaved schedule", "global_batch=3"],
        ),
        # A coefficient out of range does not hide the layout's problems (a size would: rules divide by it).
        (
            ["--model.aux_loss_coef=-1", "--parallel.tp=3"],
            3,
            ["aux_loss_coef=-1.0 must be >= 0", "n_heads=8 is not divisible by parallel.tp=3"],
        ),
    ],
)
def test_independent_problems_are_reported_together(overrides, world, expected):
    problems = validate(load_config(None, overrides), world)
    assert len(problems) == len(expected), problems
    for text in expected:
        assert any(text in p for p in problems), (text, problems)


def test_dp_shard_absorbs_the_world():
    cfg = load_config(
        None, ["--parallel.tp=2", "--parallel.pp=2", "--training.global_batch=16", "--training.micro_batch=2"]
    )
    assert validate(cfg, 16) == []
    assert cfg.parallel.dp_shard_for(16) == 4


@pytest.mark.parametrize(
    "name",
    ["tiny", "tiny-moe", "llama3-1b", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "mixtral-8x22b",
     "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"],
)  # fmt: skip
def test_presets_validate(name):
    cfg = load_config(None, [f"--model.name={name}"])
    assert validate(cfg, 1) == []
    assert model_preset(name)["dim"] == cfg.model.dim


# The fields of each model's published config.json (Hugging Face: Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B,
# mistralai/Mixtral-8x22B-v0.1) that the converter reads.
_QWEN3_MOE_JSON = dict(
    model_type="qwen3_moe", head_dim=128, hidden_act="silu", num_attention_heads=None, num_key_value_heads=4,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, router_aux_loss_coef=0.001, attention_bias=False,
    initializer_range=0.02, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
    max_position_embeddings=40960, vocab_size=151936,
)  # fmt: skip
PUBLISHED_CONFIGS = {
    "qwen3-30b-a3b": dict(_QWEN3_MOE_JSON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, moe_intermediate_size=768, max_window_layers=48),
    "qwen3-235b-a22b": dict(_QWEN3_MOE_JSON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                            num_attention_heads=64, moe_intermediate_size=1536, max_window_layers=94),
    "mixtral-8x22b": dict(model_type="mixtral", hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                          num_attention_heads=48, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                          hidden_act="silu", rms_norm_eps=1e-5, rope_theta=1e6, router_aux_loss_coef=0.001,
                          initializer_range=0.02, tie_word_embeddings=False, sliding_window=None,
                          max_position_embeddings=65536, vocab_size=32000),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_presets_are_the_published_architectures(name):
    """A preset is the model its name says: every field equals what its config.json converts to."""
    from meshtron.config.huggingface import config_from_hf

    preset = load_config(None, [f"--model.name={name}"]).model
    published = dataclasses.replace(config_from_hf(PUBLISHED_CONFIGS[name]), name=name)
    assert preset.expert_ffn_dim == published.expert_ffn_dim  # Mixtral's preset leaves it to ffn_dim (0)
    assert dataclasses.replace(preset, moe_ffn_dim=published.moe_ffn_dim) == published


def test_preset_files_load_and_validate():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.glob("*.toml"))
    assert {f.stem for f in files} >= {"demo", "tiny-moe", "llama3-8b", "llama3-70b", "mixtral-8x7b"}
    for f in files:
        if "init_from" in load_toml(f).get("model", {}):
            continue  # it needs its checkpoint on disk: tests/test_init_from_hf.py gives it one
        cfg = load_config(f)
        world = int(
            cfg.parallel.dp_replicate
            * max(cfg.parallel.dp_shard, 1)
            * cfg.parallel.tp
            * cfg.parallel.pp
            * cfg.parallel.cp
        )
        assert validate(cfg, world) == [], f


def literal_options() -> list[tuple[str, tuple]]:
    """(section.key, its options) of every enumerated config option with string options."""
    out = []
    for section in dataclasses.fields(Config):
        for key, hint in typing.get_type_hints(section.default_factory).items():
            options = typing.get_args(hint)
            if typing.get_origin(hint) is typing.Literal and isinstance(options[0], str):
                out.append((f"{section.name}.{key}", options))
    return out


@pytest.mark.parametrize("where, options", literal_options())
def test_every_enumerated_option_suggests_the_near_miss(where, options):
    option = options[-1]
    typo = option[:-1] + ("x" if option[-1] != "x" else "y")
    problems = validate(load_config(None, [f"--{where}={typo}"]), 1)
    assert problems == [f"{where}={typo!r} is not one of {', '.join(options)}; did you mean {option!r}?"]


def test_v_schedules_imply_two_chunks_per_rank():
    """A V holds two chunks per rank by definition: vpp = 2 unless set; an explicit other value is refused."""
    for schedule in ("zbv", "dualpipev"):
        overrides = ["--parallel.pp=2", f"--parallel.pp_schedule={schedule}", "--training.global_batch=32"]
        overrides += ["--training.micro_batch=2"]
        cfg = load_config(None, overrides)
        assert cfg.parallel.vpp == 2 and validate(cfg, 2) == []
        refused = validate(load_config(None, [*overrides, "--parallel.vpp=1"]), 2)
        assert refused == [
            f"parallel.pp_schedule='{schedule}' holds two chunks per rank in a V: set parallel.vpp=2"
        ]
    assert load_config(None, ["--parallel.pp=2"]).parallel.vpp == 1


def test_a_world_size_that_does_not_fit_is_one_problem_with_fixes_that_work():
    """--nproc 3 with tp=2: one problem, offering world sizes that fit and degrees that divide 3; each fix
    named passes."""
    problems = validate(load_config(None, ["--parallel.tp=2"]), 3)
    assert problems == [
        "the world size 3 is not divisible by tp=2 (dp_shard takes the rest); launch --nproc 2 or --nproc 4, "
        "or use tp in [1, 3]"
    ]
    for world, tp in ((2, 2), (4, 2), (3, 1), (3, 3)):
        layout = validate(load_config(None, [f"--parallel.tp={tp}", "--model.n_heads=6", "--model.dim=96",
                                             "--model.n_kv_heads=6", "--model.ffn_dim=96", "--training.global_batch=12",
                                             "--training.micro_batch=1"]), world)  # fmt: skip
        assert layout == [], (world, tp, layout)
    explicit = validate(load_config(None, ["--parallel.dp_shard=3", "--training.global_batch=24"]), 4)
    assert explicit == [
        "the dims multiply to dp_shard=3 but the world size is 4; launch --nproc 3, or set parallel.dp_shard=4 "
        "(or -1, which takes the rest)"
    ]


@pytest.mark.parametrize(
    "model, offered",
    [
        (["--model.n_heads=8", "--model.dim=256", "--model.ffn_dim=688"], [1, 2, 4, 8]),  # the demo's
        # a shared expert of 96 and experts cut by tp (etp = tp): 32 divides them all, the 2 KV heads too
        (
            [
                "--model.name=tiny-moe",
                "--model.n_heads=32",
                "--model.dim=256",
                "--model.ffn_dim=64",
                "--model.n_kv_heads=2",
            ],
            [1, 2, 4, 8, 16, 32],
        ),  # fmt: skip
        (["--model.n_heads=7", "--model.dim=224", "--model.n_kv_heads=7", "--model.ffn_dim=176"], []),
    ],
)
def test_every_tp_rule_offers_the_degrees_that_pass_them_all(model, offered):
    """tp=3 breaks several splits at once: each message offers the same degrees, those that pass every
    split (it used to list each width's own divisors, e.g. 43 for an FFN of 688 with 8 heads), and each
    offered degree does pass."""
    problems = [
        q for q in validate(load_config(None, [*model, "--parallel.tp=3"]), 3) if "parallel.tp=3" in q
    ]
    fix = f"use tp in {offered}" if offered else "no tp > 1 splits this model: use tp=1"
    assert len(problems) >= 2 and all(q.endswith(fix) for q in problems), problems
    for tp in offered:
        world = [f"--parallel.tp={tp}", "--training.global_batch=8", "--training.micro_batch=1"]
        assert validate(load_config(None, [*model, *world]), tp) == [], tp


def test_a_preset_named_on_the_command_line_wins_over_the_files_model(tmp_path):
    """`--model.name=llama3-8b` on configs/demo.toml gave a 4-layer "llama3-8b" without a word. A preset
    named on the command line replaces the file's keys it sets (the file's others stay), the command
    line's --model.KEY override it, and a note says which keys won over it."""
    from meshtron.config.presets import PRESETS
    from meshtron.rules.checks import config_notes

    path = tmp_path / "run.toml"
    path.write_text("[model]\ndim = 256\nn_layers = 4\nqk_norm = true\n")
    overrides = ["--model.name=llama3-8b", "--model.n_layers=2"]
    m = load_config(path, overrides).model
    assert (m.dim, m.n_layers, m.qk_norm) == (PRESETS["llama3-8b"]["dim"], 2, True)
    assert config_notes(path, overrides) == [
        "note: model.name='llama3-8b' (a preset, named on the command line): n_layers=2 (command line) in "
        f"place of its 32; the preset's values replace {path}'s dim=256"
    ]


def test_a_preset_named_in_the_file_is_overridden_by_the_keys_beside_it(tmp_path):
    from meshtron.rules.checks import config_notes

    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "tiny"\nn_layers = 3\ndim = 64\n')  # dim: the preset's own value
    assert load_config(path, []).model.n_layers == 3
    assert load_config(path, ["--model.n_layers=5"]).model.n_layers == 5
    assert config_notes(path, []) == [
        f"note: model.name='tiny' (a preset, named in {path}): n_layers=3 ({path}) in place of its 2"
    ]
    assert config_notes(path, ["--model.n_layers=2"]) == []  # the preset's own value: nothing to say
    assert config_notes(None, ["--model.name=tiny"]) == []
