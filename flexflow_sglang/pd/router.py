"""Minimal PD request routing: one request to a prefill and a decode server with a shared bootstrap room.

This is what SGLang's router does for ``--pd-disaggregation`` (the prefill server computes the KV and
sends it to the decode server that the room pairs it with); kept here so tests and benchmarks need no
extra service. Both requests carry ``bootstrap_host`` / ``bootstrap_port`` (the prefill server's
bootstrap server) and the same ``bootstrap_room``; the decode server's response is the answer.
"""

from __future__ import annotations

import random
import threading
from typing import Optional

import requests


class PDRequestError(RuntimeError):
    pass


def pd_generate(prefill_url: str, decode_url: str, bootstrap_host: str, bootstrap_port: int, payload: dict,
                timeout: float = 300.0, room: Optional[int] = None) -> dict:
    """POST `payload` (an SGLang /generate body) to both servers; return the decode server's JSON."""
    body = dict(payload)
    body.update(bootstrap_host=bootstrap_host, bootstrap_port=int(bootstrap_port),
                bootstrap_room=int(room) if room is not None else random.getrandbits(62))
    out: dict = {}

    def post(role: str, url: str) -> None:
        try:
            r = requests.post(url.rstrip("/") + "/generate", json=body, timeout=timeout)
            out[role] = (r.status_code, r.json() if r.headers.get("content-type", "").startswith("application/json")
                         else r.text)
        except Exception as e:  # reported below with the role that failed
            out[role] = (None, repr(e))

    threads = [threading.Thread(target=post, args=(role, url), daemon=True)
               for role, url in (("prefill", prefill_url), ("decode", decode_url))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5.0)
    for role in ("prefill", "decode"):
        status, data = out.get(role, (None, "no response"))
        if status != 200:
            raise PDRequestError(f"PD {role} server ({prefill_url if role == 'prefill' else decode_url}) "
                                 f"room {body['bootstrap_room']}: HTTP {status}: {str(data)[:500]}")
    return out["decode"][1]
