"""Prefill/decode disaggregation behind the SGLang model gateway's PD mode (SERVING_CONVENTIONS §9).

- ``worker``: a server's side of a pair, the HTTP server's one door (``--disaggregation-mode``);
- ``prefill``: P's bootstrap rooms and the bootstrap server D registers with and polls;
- ``decode``: D's reservation, registration, heartbeat and fetch;
- ``transfer``: how the pages cross (``--disaggregation-transfer-backend``);
- ``handoff``: what crosses: D's page reservation, P's prefilled state;
- ``config``: the flags, SGLang's timeouts and heartbeat variables, the room states.

What moves for V4.1 is a prompt's global state, as the hierarchical cache stores it
(serve/kv_pages.py: each KV source's compressed KV and indexer keys, whole pages), and the first
token P sampled. D treats the pages as a prefix hit: the window rings and the partial last page are
rebuilt by encoder replay, and the Engram look-back comes from the prompt D was sent too.
"""
