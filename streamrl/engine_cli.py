"""Run a vLLM OpenAI server with runtime LoRA loading and processed (sampling) logprobs."""

from __future__ import annotations

import argparse
import signal
import threading

from .engine import Engine, EngineConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model path or id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--device", default=None, help="CUDA device index for vLLM")
    p.add_argument("--no-token-capture", action="store_true",
                   help="a plain vLLM server: no capture frames for the gateway (it then asks for logprobs in the JSON)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="further vLLM arguments after --")


def run(args: argparse.Namespace) -> int:
    extra = [a for a in args.extra if a != "--"]
    engine = Engine(EngineConfig(model=args.model, host=args.host, port=args.port,
                                 max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
                                 max_model_len=args.max_model_len,
                                 gpu_memory_utilization=args.gpu_memory_utilization, device=args.device,
                                 token_capture=not args.no_token_capture, extra_args=extra)).start()
    print(f"engine ready: {engine.url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        if engine.proc is not None and engine.proc.poll() is not None:
            return 1
    engine.stop()
    return 0
