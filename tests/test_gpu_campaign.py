"""The GPU campaign (``scripts/gpu_campaign.sh``), rehearsed on the CPU at tiny shapes.

The rehearsal runs the script's whole sequence as a GPU machine would (tests, model writing,
both backends' benchmarks, the report), so that the day a GPU is lent the campaign is known
to run. The shapes of the real pairs are checked against the published parameter counts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smcspec.backends.torch.kernels import KERNEL_SETS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_campaign  # noqa: E402

# the parameter counts on the model cards (safetensors metadata of each Hugging Face repo)
PUBLISHED = {
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-0.5b": 494_032_768,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "qwen2.5-32b": 32_763_876_352,
    "llama-3.1-70b": 70_553_706_496,
}


def test_real_shapes_have_the_published_parameter_counts():
    shapes = [s for pair in gpu_campaign.PAIRS.values() for s in pair]
    assert {s.name: s.parameters() for s in shapes} == PUBLISHED


def test_tied_embeddings_write_no_output_matrix():
    qwen, llama = gpu_campaign.PAIRS["qwen"][0], gpu_campaign.PAIRS["llama"][0]
    assert "output.weight" not in dict(gpu_campaign.gguf_tensors(qwen))
    assert dict(gpu_campaign.gguf_tensors(llama))["output.weight"] == (128256, 4096)
    assert "blk.0.attn_q.bias" in dict(gpu_campaign.gguf_tensors(qwen))  # qwen2: q/k/v bias
    assert "blk.0.attn_q.bias" not in dict(gpu_campaign.gguf_tensors(llama))


def test_synthetic_tokenizer_has_the_real_vocabulary_size():
    tok = gpu_campaign.synthetic_tokenizer(151936)
    assert len(tok) == 151936 and tok.eos_token_id == 151935
    assert tok.decode([3, 4]) == "t3 t4"


@pytest.mark.slow
def test_cpu_rehearsal_runs_every_step(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CAMPAIGN_WORK": str(tmp_path / "work")}
    proc = subprocess.run(
        ["bash", "scripts/gpu_campaign.sh", "--device", "cpu", "--tiny", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_rehearsal(out)


def check_rehearsal(out: Path) -> None:
    """What a rehearsal's folder ``out`` must hold (every step ran, the report's sections)."""
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["kind"] in ("error", "skipped")], rows
    backends = ["torch"]
    if importlib.util.find_spec("llama_cpp") is not None:
        backends.append("llamacpp")
    runs = [r for r in rows if r["kind"] == "run"]
    torch_runs = [r for r in runs if r["backend"] == "torch"]
    # torch: llama (ar and smc-n8-k8 as steps and graphs, and with the written and
    # flex kernel sets, --tiny's; ar + 2 smc + 2 sd; the frontier group; ar and smc
    # at batch 4; ar and smc-n8-k8 with FP8 projections), then qwen32 and llama70 with FP8
    # projections (ar + 1 smc + 2 sd; batch 4)
    assert len(torch_runs) == 4 + 4 + 5 + 4 + 2 + 2 + 2 * 6
    frontier = [r["system"] for r in torch_runs
                if (r["method"], r["n"]) == ("sd", 8) or r["round_end"] == "ess"]  # fmt: skip
    assert sorted(frontier) == ["sd-n8-k4", "smc-n8-k8-ess"]
    fp8_pairs = {"llama-fp8": 2, "qwen32-fp8": 6, "llama70-fp8": 6}
    assert {p: sum(r["pair"] == p for r in torch_runs) for p in fp8_pairs} == fp8_pairs
    assert {r["rounds"] for r in torch_runs} == {"steps", "auto"}
    sets = ["eager", "flex"]  # --tiny's (the compiled and layer sets: test_layer_kernels.py)
    chosen = [(r["system"], r["kernels"]) for r in torch_runs if r["kernel_mode"] != "auto"]
    assert chosen == [(f"{m} [{s}]", s) for m in ("ar", "smc-n8-k8") for s in sets]
    assert {r["kernels"] for r in torch_runs if r["kernel_mode"] == "auto"} == {"eager"}  # CPU
    # the request profiled on the written and the flex kernels (the rehearsal's two):
    # kernels a round, the flex set's fewer
    profiles = {r["kernels_run"]: r["kernels_per_round"] for r in rows
                if r["kind"] == "device-profile"}  # fmt: skip
    assert set(profiles) == {"eager", "flex"} and profiles["flex"] < profiles["eager"]
    # llamacpp: 2 pairs x (ar + 2 smc + 2 sd upper bounds + ar and smc at batch 4)
    assert len(runs) - len(torch_runs) == (2 * 7 if "llamacpp" in backends else 0)
    assert all(r["tokens_per_s"] > 0 and r["tokens"] >= 16 for r in runs)
    assert all(r["stats"]["acceptance_rate"] == 1.0 for r in runs if r["upper_bound"])
    kinds = [r["kind"] for r in rows]
    cells = 2 + 1 + 1 + 1  # (N, K) cells of the torch pairs (llama-fp8: its group's one)
    assert kinds.count("roofline-fused") == kinds.count("bound") == cells
    assert kinds.count("roofline") == cells + (2 * 2 if "llamacpp" in backends else 0)
    assert all(r["measured_costs"] > 0 for r in rows if r["kind"].startswith("roofline"))
    assert kinds.count("profile") == 1
    # the tuner on the device: the main torch pair's costs, the real pair's acceptance file
    (tuned,) = [r for r in rows if r["kind"] == "tuned"]
    assert tuned["pair"] == "llama" and "benchmarks/pair_stats/" in tuned["acceptance_source"]
    assert tuned["smc"]["ess"] >= tuned["min_ess"] and tuned["smc"]["setting"].startswith("smc-n")
    assert int(tuned["smc"]["setting"].split("-")[1][1:]) >= tuned["min_particles"]
    report = (out / "report.md").read_text()
    for backend in backends:
        for pair in ("qwen2", "llama"):
            if (backend, pair) != ("torch", "qwen2"):  # torch's default pairs: no small qwen
                assert f"## {backend}: tiny-{pair}-target / tiny-{pair}-draft" in report
    assert "## torch: tiny-llama-70-target / tiny-llama-70-draft with FP8 projections" in report
    assert "## torch: tiny-llama-target / tiny-llama-draft with FP8 projections" in report
    (converted,) = [r for r in rows if r["kind"] == "fp8"]
    assert converted["pair"] == "llama-fp8" and converted["bytes_saved"] > 0
    torch_loads = [r for r in rows if r["kind"] == "load" and r["backend"] == "torch"]
    loads = {r["pair"]: r["weights"] for r in torch_loads}
    assert loads == {"llama": "native", "qwen32-fp8": "fp8", "llama70-fp8": "fp8"}
    assert "## The tuner on this device: torch, tiny-llama-target" in report
    assert "## Kernel sets: item 1's prediction beside the measurement" in report
    assert "| smc-n8-k8 [flex] (llama) | flex |" in report
    assert (out / "tokens_per_s.png").stat().st_size > 1000
    # what a lent machine can bring back: at most 8 files, none in a subfolder
    assert len(list(out.iterdir())) <= 8 and all(p.is_file() for p in out.iterdir())
    assert "pytest-torch.log" in os.listdir(out)


def report_only(out: Path, rows: list[dict]) -> str:
    """Write ``rows`` as ``out/results.jsonl``, rebuild the report with ``--report-only`` and
    return ``report.md``."""
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gpu_campaign.main(["--device", "cpu", "--out", str(out), "--report-only"]) == 0
    return (out / "report.md").read_text()


def test_report_only_rebuilds_the_report_from_joined_rows(tmp_path):
    rows = [
        {
            "kind": "environment",
            "date_utc": "2026-11-26 00:00",
            "device": "cuda",
            "tiny": False,
            "command": "python benchmarks/gpu_campaign.py --backends torch",
        },
        {
            "kind": "run",
            "system": "ar",
            "method": "ar",
            "n": 1,
            "k": 0,
            "batch": 1,
            "backend": "torch",
            "pair": "llama",
            "target": "llama-3.1-8b",
            "draft": "llama-3.2-1b",
            "tokens_per_s": 100.0,
            "all_tokens_per_s": [100.0],
        },
        {
            "kind": "run",
            "system": "smc-n8-k8",
            "method": "smc",
            "n": 8,
            "k": 8,
            "batch": 1,
            "backend": "torch",
            "pair": "llama",
            "target": "llama-3.1-8b",
            "draft": "llama-3.2-1b",
            "tokens_per_s": 310.0,
            "all_tokens_per_s": [310.0],
            "tokens": 64,
        },
        {
            "kind": "roofline",
            "backend": "torch",
            "pair": "llama",
            "n": 8,
            "k": 8,
            "measured_costs": 3.5,
            "memory_bound": 4.0,
        },
        {"kind": "skipped", "what": "llamacpp/llama: the build failed"},
    ]
    report = report_only(tmp_path, rows)
    assert "| smc-n8-k8 | 1 | 64 | 310.0 | 3.10 | 3.50 | 4.00 | - | - | 310.0 |" in report
    assert "- llamacpp/llama: the build failed" in report
    assert "--backends torch" in report


def test_batch_one_adds_no_second_batch_one_group():
    args = gpu_campaign.parse_args(
        ["--device", "cpu", "--out", "/tmp/unused", "--particles", "4", "--draft-tokens", "8"]
        + ["--batches", "1,8"]
    )
    groups = gpu_campaign.systems(args, upper_bound=False, backend="llamacpp")
    labels = [[(s.label, s.batch) for s in g] for g in groups]
    assert labels == [[("ar", 1), ("smc-n4-k8", 1)], [("ar", 8), ("smc-n8-k8", 8)]]


def test_report_only_takes_each_rows_ar_from_its_own_call(tmp_path):
    """Two calls joined in one ``results.jsonl`` (as a campaign and a later rerun on another
    machine are): each ratio divides by the ``ar`` its own call measured, not the last one."""

    def run(system: str, method: str, n: int, k: int, tps: float) -> dict:
        return {
            "kind": "run",
            "system": system,
            "method": method,
            "n": n,
            "k": k,
            "batch": 1,
            "backend": "llamacpp",
            "pair": "llama",
            "target": "llama-3.1-8b",
            "draft": "llama-3.2-1b",
            "tokens_per_s": tps,
            "all_tokens_per_s": [tps],
            "tokens": 128,
        }

    env = {"kind": "environment", "date_utc": "2026-11-27 00:00", "device": "cuda", "tiny": False}
    rows = [
        {**env, "command": "python benchmarks/gpu_campaign.py --draft-tokens 8"},
        run("ar", "ar", 1, 0, 100.0),
        run("smc-n4-k8", "smc", 4, 8, 150.0),
        {**env, "command": "python benchmarks/gpu_campaign.py --draft-tokens 12"},
        run("ar", "ar", 1, 0, 200.0),
        run("smc-n4-k12", "smc", 4, 12, 300.0),
    ]
    report = report_only(tmp_path, rows)
    assert "| smc-n4-k8 (call 1) | 1 | 128 | 150.0 | 1.50 |" in report
    assert "| smc-n4-k12 (call 2) | 1 | 128 | 300.0 | 1.50 |" in report
    assert "| ar (call 1) | 1 | 128 | 100.0 | 1.00 |" in report
    assert "--draft-tokens 12" in report


def test_llama_speculative_log_gives_round_cost_and_a_labelled_prediction():
    import llama_speculative_gpu as spec

    # the lines llama-speculative's main() ends with (llama.cpp as vendored), log prefixes kept
    log = "".join(
        f"0.00.037.7{i:02d} I {line}\n"
        for i, line in enumerate([
            "encoded  128 tokens in    0.050 seconds, speed: 2560.000 t/s",
            "decoded  130 tokens in    0.650 seconds, speed:  200.000 t/s", "",
            "n_draft   = 8", "n_predict = 130", "n_drafted = 200", "n_accept  = 105",
            "accept    = 52.500%",
        ])
    )  # fmt: skip
    run = spec.parse(log, k=8)
    assert run["rounds"] == 25 and run["round_s"] == pytest.approx(0.026)
    assert (run["tokens"], run["accepted"], run["prompt_s"]) == (130, 105, 0.05)
    with pytest.raises(ValueError, match="no timings"):
        spec.parse("error: failed to load model\n", k=8)
    # Leviathan et al. eq. 1: alpha 0 gives the bonus token only, alpha 1 all K + 1
    assert spec.tokens_per_round(0.0, 8) == 1.0 and spec.tokens_per_round(1.0, 8) == 9.0
    assert spec.tokens_per_round(0.5, 2) == pytest.approx(1.75)
    row = {"kind": "llama-speculative", "phase": 1, "backend": "llamacpp", "pair": "llama",
           "k": 8, "round_s": 0.026, "tokens_per_s": 185.7, "decode_tokens_per_s": 200.0,
           "acceptance_random_weights": 0.525, "alpha": 0.76, "reps": 3, "command": "x",
           "predicted_tokens_per_s": spec.tokens_per_round(0.76, 8) / 0.026}  # fmt: skip
    text = "\n".join(spec.report_lines([row], {(1, "llamacpp", "llama"): 150.0}))
    assert (
        "| llama | 8 | 26.00 | 185.7 | 200.0 | 0.53 | 146.7 (alpha 0.760) | 0.98 predicted |"
        in text
    )


def test_kernel_predictions_stand_beside_the_measurements():
    """The report's kernel-set section: each run's tokens/s beside the predicted tokens/s of
    its kernel set, each device profile beside the predicted kernels and device time a round,
    a ratio more than 20% from 1 flagged; rows the predictions do not cover (another N or K,
    rounds step by step, another pair) are left out. Broken variants: flagging only past 50%;
    keeping every pair's rows."""
    import campaign_kernels

    pred = {
        "tokens": {"layer": {"set": "layer", "n": 8, "k": 8,
                             "predicted_h200": {"ar_tokens_per_s": 182.0,
                                                "smc_tokens_per_s": 577.8}}},
        "request": {"layer": {"set": "layer", "kernels_per_round": 2900.0,
                              "predicted_h200": {"device_ms_per_round": 18.0}}},
    }  # fmt: skip
    run = {"kind": "run", "backend": "torch", "batch": 1, "pair": "llama", "kernels": "layer"}
    rows = [
        {**run, "system": "ar [layer]", "method": "ar", "n": 1, "k": 0, "tokens_per_s": 170.0},
        {**run, "system": "smc-n8-k8 [layer]", "method": "smc", "n": 8, "k": 8,
         "tokens_per_s": 400.0},
        {**run, "system": "smc-n4-k8 [layer]", "method": "smc", "n": 4, "k": 8,
         "tokens_per_s": 300.0},
        {**run, "system": "ar [steps]", "method": "ar", "n": 1, "k": 0, "rounds": "steps",
         "tokens_per_s": 30.0},
        {**run, "system": "ar", "pair": "llama-fp8", "method": "ar", "n": 1, "k": 0,
         "tokens_per_s": 300.0},
        {"kind": "device-profile", "kernels_run": "layer", "pair": "llama", "n": 8, "k": 8,
         "prompt": 128, "new": 64, "kernels_per_round": 3000.0, "device_ms_per_round": 17.1},
    ]  # fmt: skip
    text = "\n".join(campaign_kernels.prediction_lines(rows, tiny=False, predictions=pred))
    assert "| ar [layer] (llama) | layer | 170.0 | 182.0 | 0.93 |" in text
    assert "| smc-n8-k8 [layer] (llama) | layer | 400.0 | 577.8 | 0.69 (off by more than" in text
    assert "smc-n4-k8" not in text  # no prediction at N=4, for steps or for another pair
    assert "[steps]" not in text and "llama-fp8" not in text
    assert "| layer (llama) | N=8 K=8, 128+64 | 3000.0 | 2900.0 | 17.1 | 18.0 | 0.95 |" in text
    assert campaign_kernels.prediction_lines(rows[:0], tiny=False, predictions=pred) == []


def prepared_call(doc: str) -> tuple[dict[str, str], list[str]]:
    """The environment and the script's arguments of docs/gpu.md's prepared call (the first
    ``bash`` block under "The next lending")."""
    import shlex

    section = doc.split("## The next lending", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    words = shlex.split(block.replace("\\\n", " "))
    env = dict(w.split("=", 1) for w in words[: words.index("bash")])
    assert words[words.index("bash") + 1] == "scripts/gpu_campaign.sh"
    return env, words[words.index("bash") + 2 :]


def test_prepared_call_matches_the_script_and_the_lending():
    """docs/gpu.md's prepared call for the next lending: every variable it sets is one the
    script reads, every script option one it takes, its CAMPAIGN_ARGS and the script's own
    torch options parse (kernel sets named right), and its budget fits one 600 s command with
    the machine's start and the transfers inside 15 device minutes. Broken variants: the doc
    still passing ``--compare-compiled 8,8`` (the option renamed) or ``PROFILE_KERNELS=
    eager,compield``, or a ``--budget-s`` of 600 (no time left for the transfers)."""
    env, argv = prepared_call((ROOT / "docs" / "gpu.md").read_text())
    script = (ROOT / "scripts" / "gpu_campaign.sh").read_text()
    assert all(f"${{{name}" in script for name in env), env
    options = dict(zip(argv[::2], argv[1::2], strict=True))
    assert set(options) <= {"--out", "--budget-s", "--torch-s", "--big-s", "--phase"}
    assert all(f"        {o})" in script for o in options)
    budget, torch_s = float(options["--budget-s"]), float(options["--torch-s"])
    assert torch_s < budget <= 570  # a 600 s command, its start and transfers within 15 min
    profile = env.get("PROFILE_KERNELS", "eager,compiled,flex,layer")
    args = gpu_campaign.parse_args(
        ["--device", "cpu", "--out", "/tmp/x", *env.get("CAMPAIGN_ARGS", "").split(),
         "--backends", "torch", "--pairs", env.get("TORCH_PAIRS", "llama"), "--profile",
         "--profile-kernels", profile]
    )  # fmt: skip
    assert args.compare_kernels == (8, 8) and args.kernel_sets == list(KERNEL_SETS)
    assert args.profile_kernels == list(KERNEL_SETS)
