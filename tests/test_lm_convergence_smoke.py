"""Smoke test of the LM convergence benchmark on CPU: a 1-layer tiny model, 2 learning rates per
optimizer and 2 SONew eps values (SONew: the 2 x 2 grid), 20 steps; checks the JSON schema, the
markdown and the plot. Plus the pure helpers of the benchmark and of its report."""

import copy
import json
import math

import jax
import jax.numpy as jnp
import pytest

from benchmarks import common, convergence_report, lm_convergence
from sonew_pax import optim

ARGV = [
    "--model", "tiny", "--layers", "1", "--batch_size", "2", "--seq_len", "16",
    "--steps", "20", "--eval_every", "10", "--eval_batches", "2", "--warmup_steps", "4",
    "--lrs_adamw", "1e-3,3e-3", "--lrs_adafactor", "1e-3,3e-3", "--lrs_sonew", "1e-3,3e-3",
    "--sonew_eps", "1e-8,1e-5", "--lrs_muon", "1e-3",
]  # fmt: skip
EPS = [1e-8, 1e-5]


def test_steps_to_reach_interpolates():
    steps, losses = [0, 10, 20], [5.0, 3.0, 2.0]
    assert convergence_report.steps_to_reach(steps, losses, 4.0) == pytest.approx(5.0)
    assert convergence_report.steps_to_reach(steps, losses, 2.0) == pytest.approx(20.0)
    assert convergence_report.steps_to_reach(steps, losses, 6.0) == 0.0
    assert convergence_report.steps_to_reach(steps, losses, 1.0) is None
    assert convergence_report.steps_to_reach([0, 10], [5.0, None], 4.0) is None


def test_run_order_round_robin_middle_first():
    order = lm_convergence.run_order({"a": [1.0, 2.0, 3.0, 4.0], "b": [5.0, 6.0, 7.0, 8.0]})
    assert order[:4] == [("a", 2.0, None), ("b", 6.0, None), ("a", 3.0, None), ("b", 7.0, None)]
    assert sorted(order) == sorted(
        (n, v, None) for n in "ab" for v in ([1, 2, 3, 4] if n == "a" else [5, 6, 7, 8])
    )


def test_run_order_sweeps_eps_at_every_lr_middle_first():
    order = lm_convergence.run_order(
        {"a": [1.0, 2.0, 3.0], "s": [4.0, 5.0]}, {"s": [0.1, 0.2, 0.3]}
    )
    assert order[:5] == [("a", 2.0, None), ("s", 4.0, 0.2), ("s", 4.0, 0.1), ("s", 4.0, 0.3),
                         ("a", 1.0, None)]  # fmt: skip
    assert len(order) == len(set(order)) == 3 + 2 * 3
    assert {(lr, e) for n, lr, e in order if n == "s"} == {
        (lr, e) for lr in (4.0, 5.0) for e in (0.1, 0.2, 0.3)
    }


def test_sonew_eps_flag():
    parse = lm_convergence.parse_args
    assert parse([]).sonew_eps == [lm_convergence.DEFAULT_SONEW_EPS]
    assert parse(["--sonew_eps", "1e-9,1e-8,1e-7"]).sonew_eps == [1e-9, 1e-8, 1e-7]
    for bad in ("", "1e-8,1e-8", "-1e-8", "x"):
        with pytest.raises(SystemExit):
            parse(["--sonew_eps", bad])


def test_sonew_b2_flag_reaches_only_sonew():
    args = lm_convergence.parse_args(["--sonew_b2", "0.99"])
    hp = lm_convergence.hyperparameters(args.sonew_eps, args.sonew_b2)
    assert hp["sonew_tridiag"]["b2"] == 0.99
    assert hp["adamw"]["b2"] == hp["adafactor"]["b2"] == lm_convergence.B2
    assert lm_convergence.parse_args([]).sonew_b2 == lm_convergence.B2
    factory = lm_convergence.base_factory("sonew_tridiag", hp["sonew_tridiag"])
    assert factory.keywords["b2"] == 0.99


def test_seconds_ratio_is_the_steps_ratio_times_the_step_time_ratio():
    runs = [
        {"optimizer": "adamw", "ms_per_step": 10.0},
        {"optimizer": "adamw", "ms_per_step": 12.0},
        {"optimizer": "adamw", "ms_per_step": 11.0},
        {"optimizer": "sonew_tridiag", "ms_per_step": 13.2},
        {"optimizer": "sonew_tridiag", "ms_per_step": None},  # an older run without a time
    ]
    times = convergence_report.step_ms(runs)
    assert times == {"adamw": 11.0, "sonew_tridiag": 13.2}
    row = {"steps_ratio_vs_adamw": 0.8, "ms_per_step": times["sonew_tridiag"]}
    assert abs(convergence_report._seconds_ratio(row, times["adamw"]) - 0.8 * 1.2) < 1e-12
    assert convergence_report._seconds_ratio({**row, "steps_ratio_vs_adamw": None}, 11.0) is None

    # Merged from several cards, one card is timed: of AdamW's, the one most optimizers ran on,
    # then the one with most of AdamW's runs.
    cards = ["H200", "H200", "H100", "H100", None]
    named = [{**run, "device": card} for run, card in zip(runs, cards, strict=True) if card]
    named[-1]["ms_per_step"] = 20.0
    assert convergence_report.timing_group(named[:3]) == ("H200", None)
    assert convergence_report.timing_group(named) == ("H100", None)
    assert convergence_report.step_ms(named, ("H100", None)) == {
        "adamw": 11.0,
        "sonew_tridiag": 20.0,
    }
    assert convergence_report.step_ms(named, ("H200", None)) == {"adamw": 11.0}

    # On one card, the times of the code that timed the most optimizers: a change to the model's
    # step moved AdamW's time, and Muon ran only on the new code.
    old = [
        {"optimizer": "adamw", "ms_per_step": 95.0},
        {"optimizer": "adamw", "ms_per_step": 96.0},
        {"optimizer": "sonew_tridiag", "ms_per_step": 98.0},
    ]
    new = [
        {"optimizer": "adamw", "ms_per_step": 89.0, "code": "b"},
        {"optimizer": "sonew_tridiag", "ms_per_step": 92.0, "code": "b"},
        {"optimizer": "muon", "ms_per_step": 148.0, "code": "b"},
    ]
    mixed = [{**run, "device": "H100"} for run in old + new]
    assert convergence_report.timing_group(mixed) == ("H100", "b")
    assert convergence_report.step_ms(mixed, ("H100", "b")) == {
        "adamw": 89.0,
        "sonew_tridiag": 92.0,
        "muon": 148.0,
    }


def test_code_fingerprint_follows_the_library_source(tmp_path):
    for name in ("sonew_pax/a.py", "sonew_pax/sub/b.py", "configs/c.gin", "benchmarks/d.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    before = common.code_fingerprint(tmp_path)
    assert len(before) == 12 and before == common.code_fingerprint(tmp_path)
    (tmp_path / "benchmarks/d.py").write_text("not the library")
    assert common.code_fingerprint(tmp_path) == before
    for name in ("sonew_pax/sub/b.py", "configs/c.gin"):
        (tmp_path / name).write_text("changed")
        assert common.code_fingerprint(tmp_path) != before
        before = common.code_fingerprint(tmp_path)
    (tmp_path / "sonew_pax/sub/b.py").rename(tmp_path / "sonew_pax/b2.py")  # a move is a change
    assert common.code_fingerprint(tmp_path) != before


def test_sonew_damping_flag_reaches_only_sonew():
    args = lm_convergence.parse_args(["--sonew_damping", "mean"])
    hp = lm_convergence.hyperparameters(sonew_damping=args.sonew_damping)
    assert hp["sonew_tridiag"]["damping"] == "mean"
    assert all("damping" not in hp[name] for name in hp if name != "sonew_tridiag")


def test_muon_bf16_is_muon_with_a_bfloat16_iteration_run_only_when_asked():
    """``muon_bf16`` differs from ``muon`` only in ``ns_dtype`` (so its runs are a row of their
    own in a table of float32 Muon's), builds a Muon whose matrix momentum is bfloat16, and a
    sweep runs it only at the rates it is given."""
    hp = lm_convergence.hyperparameters_of(lm_convergence.parse_args([]))
    assert hp["muon_bf16"] == {**hp["muon"], "ns_dtype": "bfloat16"}
    assert all("ns_dtype" not in hp[name] for name in hp if name != "muon_bf16")
    params = {"layer_0": {"mlp": {"wi": jnp.zeros((4, 3))}}}
    for name, dtype in (("muon", jnp.float32), ("muon_bf16", jnp.bfloat16)):
        tx = lm_convergence.base_factory(name, hp[name])(1e-3)
        matrices = {leaf.dtype for leaf in jax.tree.leaves(tx.init(params)) if leaf.ndim == 2}
        assert matrices == {jnp.dtype(dtype)}
    assert lm_convergence.parse_args([]).lrs_muon_bf16 == []
    assert lm_convergence.parse_args([]).lrs_muon != []
    asked = lm_convergence.parse_args(["--runs", "muon_bf16:2e-3:0"])
    assert (asked.lrs_muon_bf16, asked.lrs_muon) == ([2e-3], [])


@pytest.mark.parametrize("flag", ["on", "off"])
def test_sonew_graft_lag_flag_reaches_sonew_and_builds(flag):
    args = lm_convergence.parse_args(["--sonew_graft_lag", flag])
    hp = lm_convergence.hyperparameters(sonew_graft_lag=args.sonew_graft_lag)["sonew_tridiag"]
    assert hp["graft_lag"] is (flag == "on")
    tx = lm_convergence.base_factory("sonew_tridiag", hp)(1e-3)
    (state,) = _states_of(tx.init({"w": jnp.zeros((4, 3))}), optim.ScaleBySONewDampedState)
    assert (state.ratio is not None) is (flag == "on")  # graft_lag's ratios
    with pytest.raises(SystemExit):
        lm_convergence.parse_args(["--sonew_graft_lag", "yes"])


def test_tiny_sweep_writes_schema_and_plot(tmp_path):
    out = tmp_path / "lm_convergence.json"
    result = lm_convergence.main([*ARGV, "--out", str(out)])

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert {"device", "date", "config", "rows", "runs"} <= written.keys()
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").stat().st_size > 0
    assert written["config"]["steps"] == 20 and written["config"]["tokenizer"].startswith("byte")

    assert written["config"]["hyperparameters"]["sonew_tridiag"]["eps"] == EPS
    assert len(written["runs"]) == 9
    swept = set(convergence_report.OPTIMIZERS) - set(lm_convergence.OPT_IN)
    assert {r["optimizer"] for r in written["rows"]} == swept
    grid = {
        (r["learning_rate"], r["eps"]) for r in written["runs"] if r["optimizer"] == "sonew_tridiag"
    }
    assert grid == {(lr, eps) for lr in (1e-3, 3e-3) for eps in EPS}
    assert all(r["eps"] is None for r in written["runs"] if r["optimizer"] != "sonew_tridiag")
    for run in written["runs"]:
        assert run["curve"]["step"] == [0, 10, 20]
        assert all(math.isfinite(x) for x in run["curve"]["eval_loss"])
        assert run["final_eval_loss"] == run["curve"]["eval_loss"][-1]
    initial = {run["curve"]["eval_loss"][0] for run in written["runs"]}
    assert max(initial) - min(initial) < 1e-5  # same initial parameters for every run
    sonew = {(r["learning_rate"], r["eps"]): r["final_eval_loss"] for r in written["runs"]}
    assert sonew[(3e-3, EPS[0])] != sonew[(3e-3, EPS[1])]  # the injected eps takes effect

    rows = {row["optimizer"]: row for row in written["rows"]}
    assert set(rows) == swept
    keys = {"optimizer", "learning_rate", "final_eval_loss", "steps_to_adamw_final",
            "steps_ratio_vs_adamw"}  # fmt: skip
    for name, row in rows.items():
        assert keys | {"eps", "lr_at_grid_edge", "eps_at_grid_edge"} <= row.keys()
        best = min(
            (r for r in written["runs"] if r["optimizer"] == name),
            key=lambda r: r["final_eval_loss"],
        )
        assert (row["final_eval_loss"], row["learning_rate"], row["eps"]) == (
            best["final_eval_loss"], best["learning_rate"], best["eps"]
        )  # fmt: skip
        assert row["lr_at_grid_edge"] is True  # two learning rates: both are edges
        assert row["eps_at_grid_edge"] is (True if name == "sonew_tridiag" else None)
    assert rows["sonew_tridiag"]["eps"] in EPS and rows["adamw"]["eps"] is None
    assert rows["adamw"]["steps_ratio_vs_adamw"] == 1.0
    assert rows["adamw"]["seconds_ratio_vs_adamw"] == 1.0
    assert all(row["ms_per_step"] > 0 for row in rows.values())
    assert rows["adamw"]["final_eval_loss"] < written["runs"][0]["curve"]["eval_loss"][0]

    md = out.with_suffix(".md").read_text()
    assert "| optimizer | learning_rate | eps |" in md and "by learning rate and eps" in md
    assert md.count("| sonew_tridiag |") == 1 + 4  # best row, every run

    # --plot_only redraws from a JSON without eps fields (written before eps was swept)
    for item in (*written["rows"], *written["runs"]):
        item.pop("eps"), item.pop("eps_at_grid_edge", None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(written))
    lm_convergence.main(["--plot_only", "--out", str(old)])
    assert old.with_suffix(".png").stat().st_size > 0
    assert "by learning rate and eps" not in old.with_suffix(".md").read_text()


def test_seeds_and_source_flags():
    parse = lm_convergence.parse_args
    assert (parse([]).seeds, parse([]).source) == ([0], "shakespeare")
    assert parse(["--seeds", "0,1,2"]).seeds == [0, 1, 2]
    bad_flags = (["--seeds", ""], ["--seeds", "1,1"], ["--seeds", "-1"], ["--source", "kjv+x"],
                 ["--spm_vocab", "-5"], ["--spm_vocab", "1"], ["--spm_vocab", "x"])  # fmt: skip
    for bad in bad_flags:
        with pytest.raises(SystemExit):
            parse(bad)
    small = parse(["--batch_size", "2", "--seq_len", "16", "--steps", "2", "--eval_batches", "1"])
    (train0, held0), (train1, held1) = (lm_convergence.load_batches(small, s) for s in (0, 1))
    assert not (train0[0]["inputs"] == train1[0]["inputs"]).all()  # the data order moves
    assert (held0[0]["inputs"] == held1[0]["inputs"]).all()  # the held-out batches do not


def _run(name, lr, seed, losses, diverged=False):
    curve = {"step": [0, 10, 20][: len(losses)], "eval_loss": losses,
             "train_loss": [None, *losses[1:]]}  # fmt: skip
    return {"optimizer": name, "learning_rate": lr, "eps": None, "seed": seed,
            "final_eval_loss": None if diverged else losses[-1], "diverged": diverged,
            "curve": curve}  # fmt: skip


def test_mean_over_seeds():
    runs = [
        _run("adamw", 1.0, 0, [5.0, 3.0, 2.0]),
        _run("adamw", 1.0, 1, [5.0, 4.0, 3.0]),
        _run("adamw", 2.0, 0, [5.0, 2.0, 1.0]),  # seed 1 not run yet: left out
        _run("sonew_tridiag", 1.0, 0, [5.0, 2.0, 1.5]),
        _run("sonew_tridiag", 1.0, 1, [5.0, None], diverged=True),
    ]
    merged = convergence_report.mean_over_seeds(runs, [0, 1])
    assert [(r["optimizer"], r["learning_rate"]) for r in merged] == [
        ("adamw", 1.0), ("sonew_tridiag", 1.0)
    ]  # fmt: skip
    adamw, sonew = merged
    assert adamw["curve"]["eval_loss"] == [5.0, 3.5, 2.5] and adamw["final_eval_loss"] == 2.5
    assert adamw["curve"]["train_loss"] == [None, 3.5, 2.5] and adamw["seeds"] == [0, 1]
    assert sonew["diverged"] and sonew["final_eval_loss"] is None
    assert sonew["curve"]["eval_loss"] == [5.0, None]
    # one seed: the runs themselves; older runs without "seed" count as the config's seed
    old = [{k: v for k, v in r.items() if k != "seed"} for r in runs[:1]]
    assert convergence_report.mean_over_seeds(old, [3])[0]["final_eval_loss"] == 2.0
    assert convergence_report.seeds_of({"seed": 3}) == [3]
    assert convergence_report.seeds_of({"seeds": [0, 2]}) == [0, 2]


def test_two_seeds_compare_mean_curves(tmp_path):
    out = tmp_path / "seeds.json"
    argv = [*ARGV[:12], "--steps", "4", "--eval_every", "2", "--warmup_steps", "1"]
    lrs = ["--lrs_adamw", "1e-3", "--lrs_adafactor", "", "--lrs_sonew", "1e-3", "--lrs_muon", ""]
    written = lm_convergence.main([*argv, *lrs, "--seeds", "0,1", "--out", str(out)])
    assert {(r["optimizer"], r["seed"]) for r in written["runs"]} == {
        (name, seed) for name in ("adamw", "sonew_tridiag") for seed in (0, 1)
    }
    assert written["config"]["seeds"] == [0, 1] and written["config"]["source"] == "shakespeare"
    finals = {(r["optimizer"], r["seed"]): r["final_eval_loss"] for r in written["runs"]}
    assert finals[("adamw", 0)] != finals[("adamw", 1)]  # the seeds train different models
    rows = {row["optimizer"]: row for row in written["rows"]}
    assert set(rows) == {"adamw", "sonew_tridiag"}  # an empty list skips Adafactor
    for name, row in rows.items():
        mean = (finals[(name, 0)] + finals[(name, 1)]) / 2
        assert row["final_eval_loss"] == pytest.approx(mean) and row["seeds"] == 2
        assert len(row["steps_ratio_vs_adamw_per_seed"]) == 2
    assert rows["adamw"]["steps_ratio_vs_adamw_per_seed"] == [1.0, 1.0]
    assert "mean of seeds 0,1, 4 steps" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0


def _result(seed, lrs, runs):
    config = {key: 1 for key in convergence_report.SAME_CONFIG}
    sonew = {"eps": [1e-9], "damping": "mean"}
    config.update(seed=seed, learning_rates={"adamw": lrs, "adafactor": [], "sonew_tridiag": lrs},
                  hyperparameters={"sonew_tridiag": sonew})  # fmt: skip
    return {"device": "cpu", "date": f"d{seed}", "params": 7, "config": config, "runs": runs}


def test_merge_chooses_on_the_sweep_seed_and_reports_every_seed_of_the_best():
    """A sweep from seed 0, its best rates re-run from seed 1, one more rate from seed 0: the
    best setting is chosen on seed 0 (the seed every setting ran) and reported averaged over
    both; ratios compare curves averaged over the seeds both settings ran."""
    sweep = _result(0, [1.0, 2.0], [
        _run("adamw", 1.0, 0, [5.0, 3.0, 2.0]), _run("adamw", 2.0, 0, [5.0, 2.5, 1.8]),
        _run("sonew_tridiag", 1.0, 0, [5.0, 2.0, 1.5]),
        _run("sonew_tridiag", 2.0, 0, [5.0, 2.2, 1.6])])  # fmt: skip
    best_again = _result(1, [2.0], [_run("adamw", 2.0, 1, [5.0, 3.5, 2.4]),
                                    _run("sonew_tridiag", 1.0, 1, [5.0, 2.4, 1.7])])  # fmt: skip
    best_again["config"]["learning_rates"]["sonew_tridiag"] = [1.0]
    wider = _result(0, [4.0], [_run("adamw", 4.0, 0, [5.0, 4.0, 3.0])])
    wider["config"]["learning_rates"]["sonew_tridiag"] = []
    wider["config"]["learning_rates"]["adamw"] = [4.0, 8.0]  # 8.0 never ran (a shard cut short)
    for run in wider["runs"]:
        del run["seed"]  # older results: the config's seed
    best_again["config"]["seeds"] = [1, 2]  # seed 2 never ran (a sweep cut by its deadline)
    best_again["code"] = "c0de"  # older results name no code
    merged = convergence_report.merge_results([sweep, best_again, wider])
    assert merged["config"]["seeds"] == [0, 1] and "seed" not in merged["config"]
    assert {run["device"] for run in merged["runs"]} == {"cpu"}  # each run names its card
    assert [run["code"] for run in merged["runs"]] == [None] * 4 + ["c0de"] * 2 + [None]
    assert merged["code"] == "c0de"
    # the grids are the rates that ran: 8.0, listed but not run, is no grid edge
    assert merged["config"]["learning_rates"]["adamw"] == [1.0, 2.0, 4.0]
    rows = {row["optimizer"]: row for row in merged["rows"]}
    adamw, sonew = rows["adamw"], rows["sonew_tridiag"]
    # chosen on seed 0 (1.8 < 2.0), though its mean over both seeds (2.1) is above lr 1.0's 2.0
    assert (adamw["learning_rate"], adamw["seeds"], adamw["lr_at_grid_edge"]) == (2.0, 2, False)
    assert adamw["final_eval_loss"] == pytest.approx(2.1)
    assert (sonew["learning_rate"], sonew["seeds"]) == (1.0, 2)
    assert sonew["final_eval_loss"] == pytest.approx(1.6)
    # mean curves: SONew [5, 2.2, 1.6] reaches 2.1 at step 10 + 10 * 0.1 / 0.6; AdamW at 20
    assert sonew["steps_ratio_vs_adamw"] == pytest.approx((10 + 10 / 6) / 20)
    # seed 0: 1.8 at 10 + 10 * 0.2 / 0.5 = 14 against 20; seed 1: 2.4 at 10 against 20
    assert sonew["steps_ratio_vs_adamw_per_seed"] == pytest.approx([0.7, 0.5])
    assert adamw["steps_ratio_vs_adamw_per_seed"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="ran twice from one seed"):
        convergence_report.merge_results([sweep, sweep])
    best_again["config"]["steps"] = 2
    with pytest.raises(ValueError, match=r"\['steps'\] differs"):
        convergence_report.merge_results([sweep, best_again])
    wider["config"]["hyperparameters"]["sonew_tridiag"]["damping"] = "absolute"
    with pytest.raises(ValueError, match="hyperparameters of sonew_tridiag"):
        convergence_report.merge_results([sweep, wider])


def test_merge_takes_an_optimizer_another_result_adds():
    """A result that adds an optimizer (``muon_bf16`` beside a table without it) merges, its
    hyperparameters join the table's; two results naming it with others do not merge."""
    table = _result(0, [1.0], [_run("adamw", 1.0, 0, [5.0, 3.0, 2.0])])
    added = _result(0, [], [_run("muon_bf16", 1.0, 0, [5.0, 2.0, 1.0])])
    added["config"]["hyperparameters"]["muon_bf16"] = {"ns_dtype": "bfloat16"}
    merged = convergence_report.merge_results([table, added])
    hp = merged["config"]["hyperparameters"]
    assert (hp["muon_bf16"], hp["sonew_tridiag"]["damping"]) == ({"ns_dtype": "bfloat16"}, "mean")
    rows = {row["optimizer"]: row for row in merged["rows"]}
    assert rows["muon_bf16"]["steps_ratio_vs_adamw"] == pytest.approx(0.5)  # 2.0 at step 10 of 20
    other = copy.deepcopy(added)
    other["runs"][0]["seed"] = 1
    other["config"]["hyperparameters"]["muon_bf16"] = {"ns_dtype": "float16"}
    with pytest.raises(ValueError, match="hyperparameters of muon_bf16"):
        convergence_report.merge_results([table, added, other])


def test_sentencepiece_vocabulary_binds_the_model(tmp_path):
    out = tmp_path / "spm.json"
    argv = [*ARGV[:12], "--steps", "2", "--eval_every", "2", "--warmup_steps", "1"]
    lrs = ["--lrs_adamw", "1e-3", "--lrs_adafactor", "", "--lrs_sonew", "", "--lrs_muon", ""]
    written = lm_convergence.main([*argv, *lrs, "--spm_vocab", "512", "--out", str(out)])
    assert written["config"]["tokenizer"] == "sentencepiece unigram (vocab 512)"
    args = lm_convergence.parse_args([*argv, "--spm_vocab", "512"])
    assert lm_convergence.model_config(args).vocab_size == 512
    assert lm_convergence.model_config(lm_convergence.parse_args(argv)).vocab_size == 256
    assert "(vocab 512) tokens" in out.with_suffix(".md").read_text()


def test_processes_split_the_sweep_and_combine_to_the_same_runs(tmp_path):
    """--processes 2 runs each setting once, in one of two child processes, and combines them
    into what one process gives (CPU: the same numbers)."""
    argv = [*ARGV[: ARGV.index("--lrs_adamw")], "--lrs_adamw", "1e-3", "--lrs_adafactor", ""]
    argv += ["--lrs_sonew", "3e-3", "--sonew_eps", "1e-8", "--lrs_muon", ""]
    argv += ["--steps", "4", "--eval_every", "2", "--warmup_steps", "1"]
    one = lm_convergence.main([*argv, "--out", str(tmp_path / "one.json")])
    out = tmp_path / "two.json"
    two = lm_convergence.main([*argv, "--processes", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(two))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{name}.{suffix}" for name in ("one", "two") for suffix in ("json", "md", "png")
    )  # the shards' files are gone
    by_key = {convergence_report.run_key(r): r["curve"] for r in one["runs"]}
    assert len(two["runs"]) == len(by_key) == 2  # each child runs one setting
    assert {convergence_report.run_key(r): r["curve"] for r in two["runs"]} == by_key
    strip = ("ms_per_step", "seconds_ratio_vs_adamw")
    assert [{k: v for k, v in row.items() if k not in strip} for row in two["rows"]] == [
        {k: v for k, v in row.items() if k not in strip} for row in one["rows"]
    ]


def test_shard_flag_is_checked():
    with pytest.raises(SystemExit):
        lm_convergence.parse_args(["--shard", "2/2"])


def test_sonew_offdiag_dtype_flag_stores_e_in_it():
    default = lm_convergence.hyperparameters_of(lm_convergence.parse_args([]))
    assert "offdiag_dtype" not in default["sonew_tridiag"]  # the library's default
    args = lm_convergence.parse_args(["--sonew_offdiag_dtype", "bfloat16"])
    hp = lm_convergence.hyperparameters_of(args, sonew_eps=0.1)["sonew_tridiag"]
    assert hp["offdiag_dtype"] == "bfloat16" and hp["eps"] == 0.1
    tx = lm_convergence.base_factory("sonew_tridiag", hp)(1e-3)
    (state,) = _states_of(tx.init({"w": jnp.zeros((4, 3))}), optim.ScaleBySONewDampedState)
    assert {leaf.dtype for leaf in jax.tree.leaves(state.e)} == {jnp.dtype(jnp.bfloat16)}
    assert {leaf.dtype for leaf in jax.tree.leaves(state.d)} == {jnp.dtype(jnp.float32)}


def test_sonew_stack_dtype_flag_reaches_sonew():
    args = ["--sonew_stack_by_shape", "on", "--sonew_stack_dtype", "bfloat16"]
    hp = lm_convergence.hyperparameters_of(lm_convergence.parse_args(args))["sonew_tridiag"]
    assert hp["stack_dtype"] == "bfloat16" and hp["stack_by_shape"]
    lm_convergence.base_factory("sonew_tridiag", hp)(1e-3)  # accepted by sonew
    alone = lm_convergence.hyperparameters_of(lm_convergence.parse_args(args[2:]))
    with pytest.raises(ValueError, match="needs stack_by_shape=True"):
        lm_convergence.base_factory("sonew_tridiag", alone["sonew_tridiag"])(1e-3)


def test_expected_seconds_is_the_optimizers_longest_run_less_compiling_else_any():
    runs = [{"optimizer": "adamw", "seconds": 10.0}, {"optimizer": "adamw", "seconds": 12.0}]
    assert lm_convergence.expected_seconds([], "adamw") is None
    assert lm_convergence.expected_seconds(runs, "adamw") == 12.0
    muon = {"optimizer": "muon", "seconds": 3.0}
    assert lm_convergence.expected_seconds([*runs, muon], "muon") == 3.0  # its own, though shorter
    assert lm_convergence.expected_seconds(runs, "sonew_tridiag") == 12.0  # none of its own yet
    compiled = [{"optimizer": "adamw", "seconds": 12.0, "compile_s": 5.0}, muon]
    assert lm_convergence.expected_seconds(compiled, "adamw") == 7.0  # its compiles are done
    assert lm_convergence.expected_seconds(compiled, "sonew_tridiag") == 12.0  # its are not


def test_runs_flag_is_exactly_those_runs_and_their_grid():
    """``--runs`` replaces the grids and seeds: its settings in its order (SONew's at each eps),
    and the lrs and seeds the results record are the runs' own."""
    args = lm_convergence.parse_args(
        ["--runs", "sonew:1e-3:0, adamw:5e-4:1,adamw:2.5e-4:0", "--sonew_eps", "1e-8,1e-5",
         "--lrs_muon", "1e-3", "--seeds", "3"]
    )  # fmt: skip
    sonew = lm_convergence.CANDIDATE
    assert lm_convergence.sweep_order(args) == [
        (sonew, 1e-3, 1e-8, 0), (sonew, 1e-3, 1e-5, 0), ("adamw", 5e-4, None, 1),
        ("adamw", 2.5e-4, None, 0),
    ]  # fmt: skip
    assert lm_convergence.learning_rates(args) == {
        "adamw": [5e-4, 2.5e-4],
        "adafactor": [],
        "muon": [],
        "muon_bf16": [],
        sonew: [1e-3],
    }
    assert args.seeds == [0, 1]
    grid = lm_convergence.parse_args(["--lrs_adamw", "1e-3", "--lrs_adafactor", "", "--lrs_muon",
                                      "", "--lrs_sonew", "", "--seeds", "0,1"])  # fmt: skip
    assert lm_convergence.sweep_order(grid) == [("adamw", 1e-3, None, 0), ("adamw", 1e-3, None, 1)]
    bad = ("", "adamw:5e-4", "adamw:5e-4:0:1", "lion:1e-3:0", "adamw:0:0", "adamw:1e-3:-1",
           "adamw:x:0", "adamw:1e-3:0,adamw:1e-3:0", "sonew_tridiag:1e-3:0")  # fmt: skip
    for text in bad:
        with pytest.raises(SystemExit):
            lm_convergence.parse_args(["--runs", text])


def test_deadline_stops_before_a_run_that_would_end_past_it(tmp_path, capsys):
    """The first run always starts; the second would end past the deadline, so the sweep stops
    and keeps the first."""
    out = tmp_path / "cut.json"
    lrs = ["--lrs_adamw", "1e-3,3e-3", "--lrs_adafactor", "", "--lrs_muon", "", "--lrs_sonew", ""]
    written = lm_convergence.main([*ARGV, *lrs, "--deadline_s", "0.01", "--out", str(out)])
    assert len(written["runs"]) == 1 and json.loads(out.read_text())["runs"] == written["runs"]
    assert "stopping before adamw" in capsys.readouterr().out


def test_compilation_cache_serves_a_later_sweep(tmp_path):
    """The first sweep compiles and writes the cache; a second sweep with new trainers (as a
    later process on the same machine builds them) loads its init, step and evaluation from it
    and trains the same run."""
    lrs = ["--lrs_adamw", "1e-3", "--lrs_adafactor", "", "--lrs_muon", "", "--lrs_sonew", ""]
    argv = [*ARGV, *lrs, "--steps", "3", "--compilation_cache", str(tmp_path / "cache")]
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # tiny programs too
    try:
        cold, warm = (
            lm_convergence.main([*argv, "--out", str(tmp_path / f"{name}.json")])["runs"][0]
            for name in ("cold", "warm")
        )
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
    assert cold["cache_hits"] == 0 and warm["cache_hits"] >= 3
    assert warm["curve"] == cold["curve"]
    assert jax.config.jax_compilation_cache_dir is None  # the process's own setting again


def test_sonew_stack_by_shape_flag_is_the_trainers_stacking():
    default = lm_convergence.hyperparameters_of(lm_convergence.parse_args([]))["sonew_tridiag"]
    assert "stack_by_shape" not in default  # the library's: earlier results keep merging
    args = lm_convergence.parse_args(["--sonew_stack_by_shape", "on"])
    hp = lm_convergence.hyperparameters_of(args, sonew_eps=0.1)["sonew_tridiag"]
    assert hp["stack_by_shape"] is True
    tx = lm_convergence.base_factory("sonew_tridiag", hp)(1e-3)
    state = tx.init({"a": jnp.zeros((4, 3)), "b": jnp.zeros((4, 3))})
    (stacked,) = _states_of(state, optim.StackedByShapeState)
    assert stacked.grouping.groups == ((0, 1),)


def _states_of(tree, kind: type) -> list:
    """The nodes of optimizer state ``tree`` that are ``kind`` (a state NamedTuple)."""
    found = lambda x: isinstance(x, kind)  # noqa: E731
    return [x for x in jax.tree.leaves(tree, is_leaf=found) if found(x)]
