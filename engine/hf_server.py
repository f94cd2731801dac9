"""Baseline (d): Hugging Face transformers ``generate`` in static batches behind a minimal
OpenAI-compatible aiohttp server — the plain-PyTorch serving a user would write otherwise.

A worker takes up to ``max_batch_size`` queued requests, left-pads them into one batch, runs
``model.generate`` (greedy, ``max_new_tokens`` = the batch's largest ``max_tokens``) in a thread,
and only then takes the next batch: static batching. Streaming is emulated by sending all of a
request's tokens when its batch ends, which is honest for the TTFT of static batching (no token
exists for the client before then). No KV cache is shared between requests.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` (``stream`` and
``stream_options.include_usage`` honoured; ``usage.prompt_tokens_details.cached_tokens`` is 0).

Run: ``python -m prefixgate.engine.hf_server --model DIR [--load-format dummy] --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

log = logging.getLogger("prefixgate.bench.hf_server")


@dataclass(slots=True)
class _Pending:
    """A queued request: prompt token ids, ``max_tokens`` and the future of its output ids."""

    prompt_ids: list[int]
    max_tokens: int
    future: asyncio.Future = field(repr=False)


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


class HFBatchServer:
    """The model, its tokenizer and the static-batching worker.

    Args:
        model_path: a Hugging Face model directory (config.json + tokenizer).
        load_format: ``"auto"`` loads the weights (``from_pretrained``); ``"dummy"``, or a
            directory without weights, builds random ones (``from_config``, seeded).
        max_batch_size: most requests per ``generate`` call.
        batch_wait_s: after the first queued request, wait this long (seconds) for more to
            form the batch.
        seed: seed of dummy weights.
    """

    def __init__(
        self,
        model_path: str,
        load_format: str = "auto",
        max_batch_size: int = 32,
        batch_wait_s: float = 0.05,
        seed: int = 0,
    ) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        path = Path(model_path)
        self.model_name = path.name
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if load_format == "dummy" or not _has_weights(path):
            config = AutoConfig.from_pretrained(model_path)
            torch.manual_seed(seed)
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            log.warning(
                "hf_server: %s has random (dummy) weights: outputs are meaningless text", model_path
            )
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.eval()
        self.max_model_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._worker: asyncio.Task | None = None

    # --- batching -------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        """aiohttp startup hook: start the batching worker."""
        self._worker = asyncio.create_task(self._loop())

    async def stop(self, app: web.Application) -> None:
        """aiohttp cleanup hook: stop the worker."""
        if self._worker is not None:
            self._worker.cancel()

    async def _loop(self) -> None:
        while True:
            batch = [await self.queue.get()]
            if self.batch_wait_s > 0:
                await asyncio.sleep(self.batch_wait_s)
            while len(batch) < self.max_batch_size and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            batch = [p for p in batch if not p.future.done()]  # client gone
            if not batch:
                continue
            try:
                outputs = await asyncio.to_thread(self._generate, batch)
            except Exception as exc:  # fail the batch, keep serving
                log.exception("generate failed")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, ids in zip(batch, outputs, strict=True):
                if not p.future.done():
                    p.future.set_result(ids)

    def _generate(self, batch: list[_Pending]) -> list[list[int]]:
        """One static batch: left-padded ``generate`` (greedy); output ids cut per request."""
        import torch

        enc = self.tokenizer.pad({"input_ids": [p.prompt_ids for p in batch]}, return_tensors="pt")
        max_new = max(p.max_tokens for p in batch)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=enc["input_ids"],
                attention_mask=enc["attention_mask"],
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :].tolist()
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        results = []
        for p, ids in zip(batch, new, strict=True):
            ids = ids[: p.max_tokens]
            for i, t in enumerate(ids):
                if t in eos_ids:
                    ids = ids[: i + 1]
                    break
            results.append(ids)
        return results

    # --- HTTP -----------------------------------------------------------------------
    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template (generation prompt added)."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions`` (greedy whatever the sampling fields say)."""
        try:
            body = await request.json()
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise ValueError("'messages' must be a non-empty list")
            mt = body.get("max_completion_tokens", body.get("max_tokens"))
            if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int)):
                raise TypeError("'max_tokens' must be an integer")
            max_tokens = 16 if mt is None else mt
            if max_tokens < 1:
                raise ValueError("'max_tokens' must be >= 1")
            ids = self.prompt_ids(messages)
            if len(ids) + max_tokens > self.max_model_len:
                raise ValueError(f"prompt + max_tokens exceeds {self.max_model_len} tokens")
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"invalid request: {exc}")
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put(_Pending(ids, max_tokens, fut))
        try:
            out_ids = await fut
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except Exception as exc:
            return _error(500, f"generation failed: {type(exc).__name__}", "server_error")
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(out_ids),
            "total_tokens": len(ids) + len(out_ids),
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        rid, created, model = (
            f"chatcmpl-{uuid.uuid4().hex}",
            int(time.time()),
            body.get("model", self.model_name),
        )
        finish = "length" if len(out_ids) >= max_tokens else "stop"
        if not body.get("stream"):
            text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
            return web.json_response(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": finish,
                        }
                    ],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

        async def send(obj: dict) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        await send(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            }
        )
        prev = ""
        for i in range(len(out_ids)):
            text = self.tokenizer.decode(out_ids[: i + 1], skip_special_tokens=True)
            piece, prev = text[len(prev) :] or " ", text  # one chunk per token, text kept whole
            last = i == len(out_ids) - 1
            await send(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": piece},
                            "finish_reason": finish if last else None,
                        }
                    ],
                }
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({**base, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``."""
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "owned_by": "hf-baseline"}],
            }
        )

    def app(self) -> web.Application:
        """The aiohttp application serving this model."""
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        app.router.add_get("/ready", lambda r: web.json_response({"status": "ready"}))
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": None}}, status=status
    )


def main(argv: list[str] | None = None) -> int:
    """Command line: serve a model with transformers' ``generate`` in static batches."""
    p = argparse.ArgumentParser(
        prog="python -m prefixgate.engine.hf_server", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-wait-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server = HFBatchServer(
        args.model, args.load_format, args.max_batch_size, args.batch_wait_ms / 1000, args.seed
    )
    log.info("hf_server: serving %s on http://%s:%d", args.model, args.host, args.port)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
