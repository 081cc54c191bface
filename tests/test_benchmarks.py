"""The benchmark scripts run (tiny sizes), so they cannot rot. Their figures are not asserted here:
speed and memory are measured by the benchmarks themselves, not by timed unit tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed  # each benchmark runs its steps on several gloo ranks

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    # no process aborted at exit either: Lightning's launcher does not pass on a child rank's exit status, but
    # its stderr is the script's ("terminate called...": a gloo worker thread still running as the interpreter exits)
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr[-4000:]
    return proc.stdout


def _table_rows(out: str) -> list[list[str]]:
    """The cells of every Markdown table row printed (header and separator lines included)."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("|")]


def test_gpu_check_cpu_smoke() -> None:
    out = _run("gpu_check.py", "--cpu")
    rows = _table_rows(out)
    routes = [r for r in rows if r[0] in ("sdpa", "math")]
    # every CPU route: two kernel shapes, one softcapped, and the pipeline, causal and not
    assert {(r[0], r[1]) for r in routes} == {("sdpa", "float32"), ("sdpa", "bfloat16"), ("math", "float32")}
    assert len(routes) == 3 * 8 and all(r[-1] == "ok" for r in routes), out
    # the softcapped block on sdpa runs on math, in bands (its route named in the row)
    assert [r[2] for r in routes if "softcap" in r[2]] == ["kernel (2, 200, 8, 2, 64) softcap 30 on math"] * 6, out
    model = [r for r in rows if r[0].startswith("llama ")]
    assert [(r[1], r[2]) for r in model] == [("math", "float32"), ("auto", "float32"), ("auto", "bfloat16")], out
    assert all(r[-1] == "ok" for r in model), out
    sharded = [r for r in rows if r[0].startswith("offload_optimizer=")]  # CPU: FSDP2 without the offload
    assert [(r[0], r[1], r[-1]) for r in sharded] == [("offload_optimizer=False", "cpu", "ok")], out
    assert sum(r[0] in ("host -> device", "device -> host", "both at once (sum)") for r in rows) == 3
    offload = [r for r in rows if len(r) == 11 and r[0].isdigit()]  # tokens, chunks, peaks, times, ..., overlap
    assert [(r[0], r[1]) for r in offload] == [("64", "1"), ("128", "2"), ("256", "4")], out
    assert all(float(r[6]) > 0 and float(r[7]) > 0 for r in offload), out  # TFLOP/s, GiB moved
    assert "search stopped: length limit" in out and "backend auto: sdpa (torch" in out
    baseline = {r[0]: r for r in rows if r[0] in ("full stack", "unbound", "full stack / unbound")}
    assert set(baseline) == {"full stack", "unbound", "full stack / unbound"}, out
    assert baseline["full stack / unbound"][2].endswith("x") and float(baseline["unbound"][2]) > 0, out
    phases = {r[0]: r for r in rows if len(r) == 3}
    assert {"attention forward", "attention backward", "MLP tiles", "loss tiles", "the rest"} <= set(phases), out
    assert all(float(phases[p][1]) > 0 for p in ("attention forward", "attention backward", "MLP tiles")), out
    mfu = [r for r in rows if len(r) == 9 and r[0] in ("llama-1b", "llama3-8b")]
    assert [(r[0], r[1]) for r in mfu] == [("llama-1b", "128"), ("llama3-8b", "256")], out
    assert all(float(r[4]) > 0 and r[-1].startswith("sdpa") for r in mfu), out  # TFLOP/s, the route named


def test_attention_benchmark_smoke() -> None:
    out = _run("attention.py", "--seq", "256", "--chunks", "2", "--repeats", "1", "--hidden", "64", "--heads", "4",
               "--sync")
    rows = {(r[0], r[1]): r for r in _table_rows(out)}
    assert set(rows) >= {("256", "ulysses"), ("256", "fpdt x2"), ("256", "fpdt x2 sync")}, out
    assert rows[("256", "ulysses")][5] == "1.000"  # the ratio column is relative to plain Ulysses
    for variant in ("fpdt x2", "fpdt x2 sync"):
        row = rows[("256", variant)]
        assert row[2] == "2" and float(row[3]) > 0 and float(row[5]) > 0, row


def test_training_benchmark_smoke() -> None:
    # two variants, both models, two lengths for the memory slopes, and the longest-sequence search up to
    # one probe past them (CPU ranks are forked, so each fresh process group costs little)
    out = _run("training.py", "--seq", "128", "256", "--hidden", "64", "--heads", "4", "--layers", "1",
               "--vocab", "256", "--repeats", "1", "--variants", "ulysses", "fpdt_full", "--models", "llama", "hf",
               "--find-longest", "--longest-limit", "512")
    assert "correctness on CPU" in out
    rows = {(r[0], r[1], r[2]): r for r in _table_rows(out)}
    for model in ("llama", "hf"):
        for variant in ("ulysses", "fpdt_full"):
            for seq in ("128", "256"):
                row = rows[(model, variant, seq)]
                assert float(row[4]) > 0 and float(row[6]) > 0 and float(row[7]) > 0, row  # tokens/s, tensors, estimate
    assert "| fpdt_full | 2     | 512 " in out  # the longest-sequence search reached its limit


def test_window_benchmark_smoke() -> None:
    out = _run("window.py", "--seq", "512", "--window", "64", "--chunks", "4", "--hidden", "64", "--heads", "4",
               "--repeats", "1")
    rows = {r[1]: r for r in _table_rows(out)}
    causal, window = rows["causal"], rows["window 64"]
    assert causal[4] == "1.000" and float(window[3]) > 0 and float(window[4]) > 0, out
    seq, w = 512, 64  # a query at i sees min(i + 1, w) keys, against causal's i + 1
    ideal = (w * seq - w * (w - 1) / 2) / (seq * (seq + 1) / 2)
    # sdpa's pieces compute exactly the pairs the window keeps: a masked rectangle would count whole
    assert window[5] == window[6] == f"{ideal:.3f}", out
    assert int(causal[7]) == 4 * 5 // 2 and int(window[7]) > 4, out  # causal's calls: one per block on or below


def test_checkpoint_io_benchmark_smoke() -> None:
    # a tiny run's replicated checkpoint exported in both dtypes (the sharded directory's export is the same call,
    # exact in tests/test_export.py; its training run and exports here would double this test's time)
    out = _run("checkpoint_io.py", "--layers", "1", "--hidden", "128", "--vocab", "256", "--repeats", "1",
               "--shardings", "replicated")
    rows = {(r[0], r[1], r[2]): r for r in _table_rows(out)}
    for sharding in ("replicated",):
        full, half = rows[("export", sharding, "float32")], rows[("export", sharding, "bfloat16")]
        assert float(full[3]) > 0 and float(full[6]) > 0 and int(full[8]) >= int(full[7]), full  # seconds, s/GB, RSS
        # the written directory: the float32 weights, or half of them (config and generation files are small)
        assert abs(float(full[5]) - float(full[4])) <= 0.01 and float(half[5]) < float(full[5]), (full, half)


def test_fit_memory_benchmark_smoke() -> None:
    # every option at a short length and a tiny model: the phases of each rank, the last step's peak of live tensors
    # (with the gradients released between steps, DDP's buckets given back before each backward) and the estimate
    out = _run("fit_memory.py", "--seq", "256", "--steps", "3", "--tensors", "--release-gradients",
               "--mmap-threshold", "131072", "--trim", "--hidden", "64", "--layers", "1", "--vocab", "256")
    assert "device_peak" in out and out.count("peak of live tensors in the last step") == 2, out
    for rank in (0, 1):
        assert f"rank {rank} (MiB): peak RSS" in out, out
    assert out.count("step 3: optimizer step") == 2 and out.count("strategy set up") == 2, out


def test_hybrid_benchmark_smoke() -> None:
    # the Qwen3.5-shaped hybrid at tiny sizes: one process and sp=2 with the stack, then the layer table (at 64 and
    # 128 tokens, the longer in two chunks in the chunked column)
    out = _run("hybrid.py", "--quick", "--seq", "128", "--layer-seq", "64", "128")
    assert "correctness: sp=2" in out
    rows = _table_rows(out)
    steps = {(r[0], r[1]): r for r in rows if len(r) == 8 and r[0] in ("sp1", "sp1_stack", "sp2", "sp2_stack")}
    assert set(steps) == {("sp1", "128"), ("sp2_stack", "128")}, out
    for (variant, _), row in steps.items():
        assert row[2] == ("1" if variant.startswith("sp1") else "2") and row[3] == ("4" if "stack" in variant else "1")
        assert all(float(row[i]) > 0 for i in (4, 5, 6, 7)), row  # s/step, tokens/s, RSS, tensors
    layers = {r[0]: r for r in rows if len(r) == 8 and r[0].isdigit()}
    assert set(layers) == {"64", "128"}, out
    assert all(float(layers[s][i]) > 0 for s in layers for i in (1, 2, 6)), out  # seconds of each layer
    assert layers["64"][4] == "-" and layers["128"][4].endswith("x"), out  # growth per doubling


def test_support_matrix_smoke(tmp_path) -> None:
    # one family measured exact at sp=2 (a Trainer step against plain transformers), one refused at construction
    # (BERT's prediction head transforms the hidden states before the output embedding); each in its own subprocess,
    # both at once
    path = tmp_path / "matrix.json"
    out = _run("support_matrix.py", "--families", "llama,bert", "--json", str(path), "--jobs", "2")
    rows = {r[0]: r for r in _table_rows(out) if r[0] in ("llama", "bert")}
    assert rows["llama"][1:3] == ["LlamaForCausalLM", "exact"] and "test_hf_causal_lm.py" in rows["llama"][4], out
    assert rows["bert"][1:3] == ["BertLMHeadModel", "refused"] and rows["bert"][3].startswith("HFCausalLM:"), out
    saved = {r["family"]: r for r in json.loads(path.read_text())}
    assert saved.keys() == {"llama", "bert"} and saved["llama"]["error"] <= 1e-10, saved
    assert "2 families: exact: 1, refused: 1" in out, out


def test_ring_benchmark_smoke() -> None:
    # Ulysses 4, Ulysses 2 x ring 2 and ring 4 at tiny sizes: the float64 gate passes, and the bytes each rank sends
    # (measured by wrapping all_to_all_single and batch_isend_irecv) are the memory model's to the byte
    out = _run("ring.py", "--smoke")
    assert "correctness gate (float64" in out and "not measuring" not in out, out
    rows = {r[0]: r for r in _table_rows(out) if len(r) == 13 and r[0] != "configuration" and r[0][0] != "-"}
    assert {c: r[1] for c, r in rows.items()} == {"ulysses 4": "4 x 1", "ulysses 2 x ring 2": "2 x 2",
                                                  "ring 4": "1 x 4"}, out
    for name, row in rows.items():
        assert float(row[2]) > 0 and float(row[10]) > 0 and row[9] == "exact", row  # s/step, peak, bytes vs model
        assert (float(row[5]) > 0) == (name != "ring 4") and (float(row[7]) > 0) == (name != "ulysses 4"), row


def test_memory_floor_benchmark_smoke() -> None:
    # the own Llama at tiny sizes, layers recomputed whole and streamed, then the memory model's longest Llama-3-8B
    out = _run("memory_floor.py", "--seq", "512", "1024", "--chunk-size", "128", "--hidden", "32", "--heads", "2",
               "--layers", "1", "--vocab", "64", "--models", "llama")
    rows = {(r[0], r[1]): r for r in _table_rows(out) if len(r) in (11, 5)}
    whole, streamed = rows[("llama", "whole")], rows[("llama", "streamed")]
    for column in (2, 3):  # the peaks at both lengths: streaming holds less
        assert float(streamed[column]) < float(whole[column]), (whole, streamed)
    assert float(rows[("1", "streamed")][2].split("M")[0]) >= 3.0, out  # one H200: at least 3M tokens
    assert float(rows[("1", "streamed")][3]) <= 141e9 / 2**30 and float(rows[("1", "streamed")][4]) > 0, out
