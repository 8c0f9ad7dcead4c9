"""Run the OpenAI-compatible gateway in front of vLLM servers; it logs every completion to Kafka."""

from __future__ import annotations

import argparse
import dataclasses

from .config import GatewayConfig

KEEP_ALIVE_S = 75
"""Idle keep-alive connections stay open this long (uvicorn's 5 s default makes agents that pause
between calls race the server's close more often)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or JSON file of GatewayConfig fields, every one of them "
                                    "(a [gateway] table if present); the flags below override it")
    p.add_argument("--upstream", action="append", help="vLLM base URL without /v1 (repeat for several)")
    p.add_argument("--bootstrap-servers", help="Kafka bootstrap servers, HOST:PORT")
    p.add_argument("--host", help="default 127.0.0.1")
    p.add_argument("--port", type=int, help="default 8080")
    p.add_argument("--topic-prefix", help="default streamrl")
    p.add_argument("--policy-name", help="stable model name of the policy being trained (default policy)")
    p.add_argument("--max-loaded-versions", type=int,
                   help="at most this many policy versions stay loaded per upstream (>= 2; default 3)")
    p.add_argument("--keep-previous-versions", type=int,
                   help="versions before the routed one kept loaded while idle, for requests pinned to them "
                        "(policy@vN); at most --max-loaded-versions - 2 (default 1)")
    p.add_argument("--max-body-bytes", type=int, help="default 16 MiB")
    p.add_argument("--upstream-timeout", type=float,
                   help="seconds without a byte from the upstream before a 504 (default 600)")
    p.add_argument("--no-logging", action="store_true",
                   help="forward only, log nothing (for measuring the gateway's overhead)")
    p.add_argument("--no-token-capture", action="store_true",
                   help="ask every upstream for token ids and logprobs in its JSON, even one that offers "
                        "capture frames (streamrl engine); for comparison")


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """``GatewayConfig.load``: defaults < ``--config`` < the flags given."""
    config = GatewayConfig.load(
        args.config, upstreams=tuple(args.upstream) if args.upstream else None,
        bootstrap_servers=args.bootstrap_servers, host=args.host, port=args.port, topic_prefix=args.topic_prefix,
        policy_name=args.policy_name, max_loaded_versions=args.max_loaded_versions,
        keep_previous_versions=args.keep_previous_versions, max_body_bytes=args.max_body_bytes,
        upstream_timeout_s=args.upstream_timeout, token_capture=False if args.no_token_capture else None)
    if args.no_logging:
        return dataclasses.replace(config, bootstrap_servers=None)
    if config.bootstrap_servers is None:
        raise SystemExit("streamrl gateway: give --bootstrap-servers (or bootstrap_servers in --config), "
                         "or --no-logging to forward without logging")
    return config


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    config = config_from_args(args)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="warning",
                access_log=False, loop="uvloop", http="httptools", timeout_keep_alive=KEEP_ALIVE_S)
    return 0
