"""prefixgate beside llama.cpp's server, over HTTP, on the same model shape and thread count.

The CPU peer a single user compares against. Both servers hold the benchmark shape (default
``../shared/models/smollm2-135m-shape``) with dummy weights: prefixgate with
``--load-format dummy``, llama.cpp with a GGUF of that shape written here by the ``gguf``
package (random weights, the model's own tokenizer; ``f32`` beside prefixgate fp32,
``q8_0`` beside prefixgate ``--quantization int8``). Weights' values do not change the time
of a step; every request bans the end-of-sequence token (``logit_bias`` -100, which both
servers take) so every answer is exactly ``max_tokens`` long.

Four measures, as the CPU-speed table of docs/benchmarks/llamacpp-peer.md:

- **batched**: ``--num-requests`` x (``--prompt-len`` in, ``--output-len`` out) sent at once;
  output tokens / wall seconds;
- **prefill**: one ``--prefill-len``-token prompt, ``max_tokens`` 1, seconds to the answer
  (a fresh prompt each trial: no cache hit);
- **warm prefix**: TTFT of ``--shared-len`` shared + ``--suffix-len`` new tokens after the shared
  part was served once, divided by the TTFT of the ``--suffix-len`` tokens alone (1.0: the shared
  part costs nothing);
- **single-stream decode**: one streaming request of ``--decode-len`` tokens; tokens/s between
  its first and last streamed token.

Rounds alternate between the servers (``--rounds``, each round every measure on each server);
the table gives medians and the min–max spread. Both servers run with the same thread count
(``--threads``: prefixgate's and llama.cpp's own flags; ``OMP_NUM_THREADS`` too).

llama.cpp is its own ``llama-server`` (on PATH, or built by
``examples/benchmarks/install_llama_server.sh``), with ``--num-requests`` parallel slots so the
batched row is batched on both sides (``--no-repack`` beside Q8_0), or else
``llama-cpp-python[server]`` (``python -m llama_cpp.server``, one sequence at a time: its batched
row is serial); when neither is installed the peer is skipped with one line and
prefixgate's figures are printed alone.

Usage::

    python -m examples.benchmarks.llamacpp_peer [--threads 2] [--int8] [--rounds 3]
        [--single-only] [--model DIR] [--gguf-dir DIR] [--json OUT]

``--single-only`` runs the single-stream decode row alone (quick iterations on decode speed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prefixgate.sdk.bench.shared import shared_dir
from prefixgate.sdk.bench.targets import free_port, terminate, wait_http_ready

from examples.benchmarks.streaming import text_chunk_times

SHARED = shared_dir()


def write_gguf(model_dir: Path, out: Path, kind: str = "f32", seed: int = 0) -> Path:
    """A GGUF file of ``model_dir``'s Llama shape with random weights and its tokenizer.

    Args:
        model_dir: a Hugging Face model folder (``config.json``, ``tokenizer.json``; a BPE
            tokenizer with merges, as SmolLM2's).
        out: the file to write (kept and reused when it exists).
        kind: ``"f32"`` or ``"q8_0"`` (2-D weights quantized; norms stay f32).
        seed: the weights' numpy seed.

    Returns:
        ``out``.

    Raises:
        ValueError: an unknown ``kind``, or a tokenizer that is not BPE (a BPE with merges
            is written as llama.cpp's ``gpt2`` vocabulary, one with byte fallback or no merges
            as its SentencePiece ``llama`` vocabulary).
    """
    import gguf
    import numpy as np

    if kind not in ("f32", "q8_0"):
        raise ValueError(f"kind must be 'f32' or 'q8_0', got {kind!r}")
    if out.exists():
        return out
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    if tok["model"]["type"] != "BPE":
        raise ValueError(
            f"{model_dir}: only BPE tokenizers are written, not {tok['model']['type']}"
        )
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
    )
    head_dim = cfg.get("head_dim", hidden // heads)
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]

    w = gguf.GGUFWriter(str(out) + ".part", "llama")
    w.add_name(model_dir.name + "-dummy")
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    w.add_vocab_size(vocab)
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if kind == "q8_0" else gguf.LlamaFileType.ALL_F32
    w.add_file_type(file_type)

    tokens = [""] * vocab
    types = [gguf.TokenType.UNUSED] * vocab
    for text, i in tok["model"]["vocab"].items():
        if i < vocab:
            tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in tok.get("added_tokens", []):
        if added["id"] < vocab:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = (
                gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
            )
    for i, text in enumerate(tokens):
        if not text:
            tokens[i] = f"[PAD{i}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_token_list(tokens)
    if tok["model"].get("byte_fallback") or not merges:
        # SentencePiece-style BPE ("▁" words, <0xNN> byte tokens; the shape model's synthetic
        # tokenizer): llama.cpp's "llama" vocabulary, ranked by id
        for i, text in enumerate(tokens):
            if types[i] == gguf.TokenType.NORMAL and len(text) == 6 and text.startswith("<0x"):
                types[i] = gguf.TokenType.BYTE
            elif text == tok["model"].get("unk_token"):
                types[i] = gguf.TokenType.UNKNOWN
                w.add_unk_token_id(i)
        w.add_tokenizer_model("llama")
        w.add_token_scores([-float(i) for i in range(vocab)])
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(int(cfg.get("bos_token_id", 1)))
    w.add_eos_token_id(int(cfg.get("eos_token_id", 2)))
    w.add_add_bos_token(False)

    rng = np.random.default_rng(seed)

    def tensor(name: str, shape: tuple[int, ...], norm: bool = False) -> None:
        if norm:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
            return
        data = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        if kind == "q8_0":
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)

    tensor("token_embd.weight", (vocab, hidden))
    tensor("output_norm.weight", (hidden,), norm=True)
    if not cfg.get("tie_word_embeddings", False):
        tensor("output.weight", (vocab, hidden))
    for b in range(layers):
        tensor(f"blk.{b}.attn_norm.weight", (hidden,), norm=True)
        tensor(f"blk.{b}.attn_q.weight", (heads * head_dim, hidden))
        tensor(f"blk.{b}.attn_k.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{b}.attn_v.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{b}.attn_output.weight", (hidden, heads * head_dim))
        tensor(f"blk.{b}.ffn_norm.weight", (hidden,), norm=True)
        tensor(f"blk.{b}.ffn_gate.weight", (inter, hidden))
        tensor(f"blk.{b}.ffn_up.weight", (inter, hidden))
        tensor(f"blk.{b}.ffn_down.weight", (hidden, inter))
    out.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(out) + ".part", out)
    return out


def llama_server_path() -> str | None:
    """llama.cpp's own ``llama-server``: on PATH, or built by
    ``examples/benchmarks/install_llama_server.sh`` under ``~/.cache/prefixgate/llama.cpp-*``."""
    exe = shutil.which("llama-server")
    if exe is not None:
        return exe
    built = sorted((Path.home() / ".cache" / "prefixgate").glob("llama.cpp-*/bin/llama-server"))
    return str(built[-1]) if built else None


def llamacpp_command(
    gguf_path: Path, port: int, threads: int, ctx: int, slots: int = 1, repack: bool = True
) -> list[str] | None:
    """The command line of llama.cpp's server on ``port``, or None when none is installed.

    ``llama-server`` (preferred) serves ``slots`` sequences at once (``-np``, continuous
    batching) with ``ctx`` tokens of KV cache each (``-c`` is the total); ``repack=False`` adds
    ``--no-repack`` (its CPU weight repacking of Q8_0 crashes on some AMX/AVX-512 builds).
    llama-cpp-python's server, the fallback, serves one sequence at a time.
    """
    exe = llama_server_path()
    if exe is not None:
        cmd = [exe, "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-t", str(threads), "-tb", str(threads), "-c", str(ctx * slots)]
        cmd += ["--parallel", str(slots), "--cont-batching", "--no-webui"]
        return cmd + ([] if repack else ["--no-repack"])
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return None
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        str(ctx),
        "--n_batch",
        "512",
    ]


def prefixgate_command(model: Path, port: int, threads: int, int8: bool, ctx: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "prefixgate.gateway.cli",
        "serve",
        "--model",
        str(model),
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(ctx),
        "--no-access-log",
        "--log-level",
        "WARNING",
        "--threads",
        str(threads),
    ]
    return cmd + (["--quantization", "int8"] if int8 else [])


class Server:
    """A server subprocess (``cmd``) on ``port``, ready once ``GET ready`` answers 200;
    its output goes to a temporary file (a pipe nobody reads fills up and stalls it: llama.cpp
    logs every GGUF key while loading)."""

    def __init__(
        self, name: str, cmd: list[str], port: int, env: dict[str, str], ready: str = "/v1/models"
    ) -> None:
        self.name, self.port, self.ready = name, port, ready
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> None:
        try:
            wait_http_ready(self.proc, self.url + self.ready, timeout, self.name, "its output")
        except RuntimeError as exc:  # it exited: its output's tail says why
            self.log.seek(0)
            err = self.log.read().decode(errors="replace")
            raise RuntimeError(f"{exc}: {err[-2000:]}") from None

    def failure(self, exc: Exception) -> str:
        """What to say of a request that failed while this server had exited: its exit code
        and its output's tail."""
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace")[-2000:]
        return f"{self.name} exited ({self.proc.returncode}) during {exc!r}; its output:\n{tail}"

    def stop(self) -> None:
        terminate(self.proc, 30, 30)
        self.log.close()


class Probe:
    """The four measures against one server's ``/v1/completions`` (text prompts)."""

    def __init__(self, server: Server, model: str, eos_id: int) -> None:
        self.server, self.model = server, model
        self.bias = {str(eos_id): -100}
        self.client = httpx.Client(base_url=server.url, timeout=600.0)

    def _body(self, prompt: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logit_bias": self.bias,
            "stream": stream,
        }

    def complete(self, prompt: str, max_tokens: int) -> float:
        t0 = time.perf_counter()
        r = self.client.post("/v1/completions", json=self._body(prompt, max_tokens))
        r.raise_for_status()
        return time.perf_counter() - t0

    def stream(self, prompt: str, max_tokens: int) -> tuple[float, float, int]:
        """(TTFT s, seconds between first and last streamed token, streamed events)."""
        t0 = time.perf_counter()
        times = text_chunk_times(self.client, self._body(prompt, max_tokens, True))
        first, last = (times[0], times[-1]) if times else (0.0, 0.0)
        return first - t0, last - first, len(times)

    def batched(self, prompts: list[str], max_tokens: int) -> float:
        """Output tokens/s of ``prompts`` sent at once."""
        import concurrent.futures

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda p: self.complete(p, max_tokens), prompts))
        return len(prompts) * max_tokens / (time.perf_counter() - t0)


def served_model(server: Server) -> str:
    """The model id a server lists first (what its completions route expects)."""
    return str(httpx.get(server.url + "/v1/models", timeout=10.0).json()["data"][0]["id"])


def make_prompts(tokenizer: Any, n: int, length: int, salt: str) -> list[str]:
    """``n`` distinct texts of about ``length`` tokens (real user tasks, a salt word first)."""
    from examples.benchmarks.engine_throughput import load_prompts

    ids = load_prompts(tokenizer, SHARED / "workloads" / "user_tasks.jsonl", n, length)
    return [f"{salt}{i}: " + tokenizer.decode(p) for i, p in enumerate(ids)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.model))
    ctx = max(args.prefill_len, args.shared_len + args.suffix_len, args.prompt_len) + 256
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    kind = "q8_0" if args.int8 else "f32"
    pg_port = free_port()
    cmd = prefixgate_command(args.model, pg_port, args.threads, args.int8, ctx)
    servers = [Server("prefixgate", cmd, pg_port, env, ready="/ready")]  # serves while loading
    gguf_path = args.gguf_dir / f"{args.model.name}-{kind}.gguf"
    port = free_port()
    # parallel slots for the batched row (every request of it at once, as prefixgate batches
    # them); no Q8_0 repacking (llama.cpp's CPU repacking of Q8_0 can crash on AVX-512 / AMX)
    slots = 1 if args.single_only else args.num_requests
    peer_cmd = llamacpp_command(gguf_path, port, args.threads, ctx, slots, repack=kind == "f32")
    if peer_cmd is None:
        print(
            "llama.cpp: not installed (examples/benchmarks/install_llama_server.sh, or "
            "pip install 'llama-cpp-python[server]'): prefixgate alone"
        )
    else:
        print("llama.cpp: " + " ".join(peer_cmd))
        write_gguf(args.model, gguf_path, kind)
        servers.append(Server("llama.cpp", peer_cmd, port, env))
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for s in servers:
            s.wait_ready()
        probes = [Probe(s, served_model(s), int(tok.eos_token_id or 2)) for s in servers]
        for p in probes:  # warm-up: first-use costs out of the figures
            p.complete("hello", 4)
            results[p.server.name] = {"batched": [], "prefill": [], "warm": [], "decode": []}
        for r in range(args.rounds):
            order = probes if r % 2 == 0 else probes[::-1]
            for p in order:
                fig = results[p.server.name]
                if args.single_only:
                    _, span, n = p.stream(f"d{r}: tell a story", args.decode_len)
                    fig["decode"].append((n - 1) / span if span > 0 and n > 1 else 0.0)
                    continue
                fig["batched"].append(
                    p.batched(
                        make_prompts(tok, args.num_requests, args.prompt_len, f"b{r}"),
                        args.output_len,
                    )
                )
                long = make_prompts(tok, 1, args.prefill_len, f"p{r}")[0]
                fig["prefill"].append(p.complete(long, 1))
                shared = make_prompts(tok, 1, args.shared_len, f"s{r}")[0]
                suffix = make_prompts(tok, 1, args.suffix_len, f"x{r}")[0]
                p.complete(shared, 1)
                warm, _, _ = p.stream(shared + suffix, 1)
                alone, _, _ = p.stream(suffix + f" {r}", 1)
                fig["warm"].append(warm / alone)
                _, span, n = p.stream(f"d{r}: tell a story", args.decode_len)
                fig["decode"].append((n - 1) / span if span > 0 and n > 1 else 0.0)
    except httpx.HTTPError as exc:  # which server failed, and why (its exit code, output)
        raise RuntimeError(
            "; ".join(s.failure(exc) for s in servers if s.proc.poll() is not None)
            or f"a request failed with every server running: {exc!r}"
        ) from exc
    finally:
        for s in servers:
            s.stop()
    return results


def table(results: dict[str, dict[str, list[float]]]) -> str:
    """Medians with min–max, and prefixgate / llama.cpp ratios where both ran."""
    rows = [
        ("batched output tok/s", "batched"),
        ("prefill s", "prefill"),
        ("warm prefix / suffix-only TTFT", "warm"),
        ("single-stream decode tok/s", "decode"),
    ]
    names = list(results)
    lines = [
        "| measure | " + " | ".join(names) + (" | ratio |" if len(names) > 1 else " |"),
        "|---" * (len(names) + 1 + (len(names) > 1)) + "|",
    ]

    def fmt(v: list[float]) -> str:
        return f"{statistics.median(v):.3g} ({min(v):.3g}–{max(v):.3g})"

    for label, key in rows:
        if not all(results[n][key] for n in names):
            continue  # a row not measured (--single-only)
        cells = [fmt(results[n][key]) for n in names]
        if len(names) > 1:
            a, b = (statistics.median(results[n][key]) for n in names[:2])
            cells.append(f"{a / b:.2f}×" if b else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=SHARED / "models" / "smollm2-135m-shape")
    ap.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache" / "prefixgate" / "gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8", action="store_true", help="prefixgate int8 beside llama.cpp Q8_0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=1088)
    ap.add_argument("--shared-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--single-only", action="store_true", help="only the single-stream decode row")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    results = run(args)
    print(
        f"threads {args.threads}, {'int8 vs Q8_0' if args.int8 else 'fp32 vs f32'}, "
        f"{args.rounds} rounds, load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(table(results))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
