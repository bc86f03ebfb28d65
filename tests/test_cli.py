"""The `radixkv` command end to end (tiny random model via the test-only `--model tiny`)."""

import io
import json
import re
import subprocess
import sys

from radixkv.cli import main
from radixkv.engine import Engine
from radixkv.sampling import SamplingParams

TINY = ["--model", "tiny", "--num-pages", "256", "--page-size", "8"]


def _table_rows(text: str) -> dict[tuple[str, str], list[str]]:
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 10 and parts[1] in ("on", "off") and parts[0] in ("few-shot", "agent"):
            rows[(parts[0], parts[1])] = parts
    return rows


def test_generate_streams_the_greedy_completion(capsys):
    assert main(["generate", "hello world", "--raw", "--max-tokens", "7", *TINY]) == 0
    printed = capsys.readouterr().out
    ref = Engine.from_pretrained("tiny", num_pages=256, page_size=8)
    want = ref.generate(["hello world"], SamplingParams(max_tokens=7, temperature=0))[0]
    assert printed == want.text + "\n"


def test_generate_reports_bad_input_clearly(capsys):
    assert main(["generate", "hi", "--temperature", "-1", *TINY]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/nonexistent/model.gguf"]) == 2
    assert "nonexistent" in capsys.readouterr().err


def test_chat_reuses_previous_turns(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("first question\nsecond question\n/exit\n"))
    assert main(["chat", "--system", "be brief", "--max-tokens", "5", "-v", *TINY]) == 0
    cap = capsys.readouterr()
    assert cap.out.count("assistant> ") == 2
    cached = [tuple(map(int, m)) for m in re.findall(r"cached (\d+)/(\d+)", cap.err)]
    assert len(cached) == 2
    first_prompt = cached[0][1]
    assert cached[1][0] >= first_prompt - 8  # turn 2 hits turn 1's prompt (minus a page)


def test_batch_orders_resumes_and_survives_bad_records(tmp_path):
    shared = "Context: " + "the quick brown fox jumps over the lazy dog. " * 4
    recs = [
        {"id": "a", "prompt": shared + "Question one?", "max_tokens": 4, "ignore_eos": True},
        {"id": "b", "prompt": "unrelated prompt", "max_tokens": 3, "ignore_eos": True},
        {"id": "c", "prompt": shared + "Question two?", "max_tokens": 4, "ignore_eos": True},
        {
            "id": "d",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "ignore_eos": True,
            "n": 2,
        },
        {"id": "bad-temp", "prompt": "x", "temperature": -1},
        {"id": "bad-field", "prompt": "x", "colour": "red"},
        {"id": "too-long", "prompt": "y" * 3000},
        {"id": "no-prompt", "max_tokens": 3},
    ]
    inp = tmp_path / "in.jsonl"
    out = tmp_path / "out.jsonl"
    lines = [json.dumps(r) for r in recs] + ["{not json"]
    inp.write_text("\n".join(lines) + "\n")
    args = ["batch", str(inp), "-o", str(out), "--no-progress", *TINY]
    assert main(args) == 0
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(got) == {r["id"] for r in recs} | {"line-9"}
    for bad in ("bad-temp", "bad-field", "too-long", "no-prompt", "line-9"):
        assert "error" in got[bad] and "text" not in got[bad]
    assert "temperature" in got["bad-temp"]["error"] and "colour" in got["bad-field"]["error"]
    assert "context" in got["too-long"]["error"]
    for rid, n in (("a", 4), ("b", 3), ("c", 4), ("d", 2)):
        assert len(got[rid]["token_ids"]) == n and got[rid]["finish_reason"] == "length"
    assert len(got["d"]["samples"]) == 2
    # a and c run back to back (sorted by prompt), so the later one hits the shared context
    assert max(got["a"]["cached_tokens"], got["c"]["cached_tokens"]) >= len(shared) - 8
    # resume: only new ids run; earlier records are not repeated
    with inp.open("a") as f:
        f.write(json.dumps({"id": "e", "prompt": shared + "Question three?", "max_tokens": 2}))
        f.write("\n")
    before = out.read_text().splitlines()
    assert main(args) == 0
    after = out.read_text().splitlines()
    assert after[: len(before)] == before
    new = [json.loads(line) for line in after[len(before) :]]
    assert [r["id"] for r in new] == ["e"] and len(new[0]["token_ids"]) <= 2


def test_demo_on_tiny_model(capsys):
    assert main(["demo", "--quick", *TINY]) == 0
    out = capsys.readouterr().out
    assert re.search(r"compiled \d+ step shapes", out)
    rows = _table_rows(out)
    assert set(rows) == {(w, c) for w in ("few-shot", "agent") for c in ("on", "off")}
    for w in ("few-shot", "agent"):
        off, on = rows[(w, "off")], rows[(w, "on")]
        assert off[2] == on[2] and off[3] == on[3]  # same requests, same prompt tokens
        assert int(off[4]) == 0 and int(on[4]) > 0  # cached tokens
        assert int(on[6]) < int(off[6])  # fewer prefill tokens computed


def test_bench_passes_its_flags_to_the_e2e_benchmark(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--workloads", "few_shot", "--scale", "0.25"]
    assert main([*argv, "--no-warmup", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["few_shot"]
    off, on = res["off"], res["on"]
    assert off["cached_tokens"] == 0 and on["cached_tokens"] > 0
    assert on["prefill_computed"] + on["cached_tokens"] == on["prompt_tokens"]
    assert on["prefill_computed"] < off["prefill_computed"] == off["prompt_tokens"]
    n = on["requests"]
    assert res["identical_outputs"] == f"{n}/{n}"
    assert "few_shot" in capsys.readouterr().out


def test_console_entry_point_help():
    r = subprocess.run(
        [sys.executable, "-m", "radixkv.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0
    for cmd in ("demo", "generate", "chat", "batch", "bench"):
        assert cmd in r.stdout


def test_demo_on_smollm2(capsys):
    """The README's main job on the embedded SmolLM2 (reduced size)."""
    assert main(["demo", "--quick", "--no-warmup", "--max-batch", "8"]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert len(rows) == 4
    for w in ("few-shot", "agent"):
        on, off = rows[(w, "on")], rows[(w, "off")]
        assert int(on[4]) > 0 and int(off[4]) == 0
        assert float(on[5].rstrip("%")) > 30.0  # hit rate of the shared-prefix workloads
