"""Run the OpenAI-compatible gateway in front of vLLM servers; it logs every completion to Kafka."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.config_flags import add_config_flags, given

from .config import GatewayConfig

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

KEEP_ALIVE_S = 75
"""Idle keep-alive connections stay open this long (uvicorn's 5 s default makes agents that pause
between calls race the server's close more often)."""


FLAG_NAMES = {"upstreams": "upstream", "upstream_timeout_s": "upstream-timeout"}
"""Fields whose flag is not simply the field's name (``--field-name``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or JSON file of GatewayConfig fields, every one of them "
                                    "(a [gateway] table if present); the flags below override it")
    p.add_argument("--no-logging", action="store_true",
                   help="forward only, log nothing (for measuring the gateway's overhead)")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind the port with SO_REUSEPORT, beside other gateway processes on it (what each of "
                        "--workers N does)")
    add_config_flags(p, GatewayConfig, names=FLAG_NAMES)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """``GatewayConfig.load``: defaults < ``--config`` < the flags given."""
    config = GatewayConfig.load(args.config, **given(args, GatewayConfig))
    if args.no_logging:
        return dataclasses.replace(config, bootstrap_servers=None)
    if config.bootstrap_servers is None:
        raise SystemExit("streamrl gateway: give --bootstrap-servers (or bootstrap_servers in --config), "
                         "or --no-logging to forward without logging")
    return config


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .workers import Workers, reuseport_socket

    config = config_from_args(args)
    if config.workers > 1:
        try:
            # the workers' config files beside the given one (``streamrl up``: in its run directory)
            return Workers(config, Path(args.config).parent / "gateway-workers" if args.config else None).run()
        except ValueError as exc:
            raise SystemExit(f"streamrl gateway: {exc}") from None
    try:
        app = create_app(config)
    except ValueError as exc:  # a bad key file, or keys missing on a public address (gateway/auth.py)
        raise SystemExit(f"streamrl gateway: {exc}") from None
    server = uvicorn.Server(uvicorn_config(app, config))
    if args.reuse_port:
        server.run(sockets=[reuseport_socket(config.host, config.port)])
    else:
        server.run()
    return 0


def uvicorn_config(app: FastAPI, config: GatewayConfig) -> uvicorn.Config:
    """How every gateway process serves (``streamrl gateway``, its workers, ``GatewayServer``)."""
    import uvicorn

    return uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                          loop="uvloop", http="httptools", timeout_keep_alive=KEEP_ALIVE_S,
                          timeout_graceful_shutdown=config.shutdown_grace_s)
