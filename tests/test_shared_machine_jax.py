"""Another local user against a ``--runtime jax`` session (tests/_two_users.py): JAX's
coordination service has no authentication, so whoever reaches it can set keys the
processes read (``key_value_set``, without even registering) or end the session by
connecting as one of its processes ("tried to connect with a different incarnation").
The attacker looks for the victim's listening sockets as any user can (/proc/net/tcp,
tcp6, unix) and tries both on each; it must reach none, and the session must still work."""

from __future__ import annotations

import json
import textwrap

import pytest

from test_jax_runtime import needs_jax

pytestmark = [pytest.mark.shared_machine, pytest.mark.jax, needs_jax, pytest.mark.timeout(400)]

# The attacker: every listening socket of the victim's it can find, and on each, a key set
# without registering and a connect as task 1.
ATTACKER = """
    import json, socket, subprocess, sys, textwrap

    VICTIM = {uid}

    def tcp():
        for name, family in (("/proc/net/tcp", socket.AF_INET),
                             ("/proc/net/tcp6", socket.AF_INET6)):
            for line in open(name).read().splitlines()[1:]:
                f = line.split()
                if f[3] != "0A" or int(f[7]) != VICTIM:  # (0A: listening)
                    continue
                address, port = f[1].split(":")
                raw = bytes.fromhex(address)
                ip = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1]
                                                        for i in range(0, len(raw), 4)))
                ip = ip[7:] if ip.startswith("::ffff:") else ip
                ip = "127.0.0.1" if ip in ("0.0.0.0", "::") else ip
                yield f"[{{ip}}]:{{int(port, 16)}}" if ":" in ip else f"{{ip}}:{{int(port, 16)}}"

    def unix():
        for line in open("/proc/net/unix").read().splitlines()[1:]:
            f = line.split()
            if len(f) > 7 and int(f[3], 16) & 0x10000 and f"/colab_xla-{{VICTIM}}/" in f[7]:
                yield "unix:" + f[7]  # (0x10000: listening)

    # Each try in a process of its own: a client that cannot connect ends its process.
    TRY = '''
    import os, sys
    from jax._src.lib import _jax
    client = _jax.get_distributed_runtime_client(
        sys.argv[1], 1, rpc_timeout=5, init_timeout=5, heartbeat_timeout=5,
        shutdown_on_destruction=False)
    if sys.argv[2] == "key_value_set":
        client.key_value_set("colab_xla_attack", "planted")
    else:
        client.connect()
    print("reached", flush=True)
    os._exit(0)
    '''

    def attempt(address, how):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(TRY), address, how],
                              capture_output=True, text=True, timeout=60)
        if done.stdout.strip() == "reached":
            return "reached"
        return f"exit {{done.returncode}}: " + " ".join(done.stderr.split()[-25:])

    targets = sorted(set(tcp()) | set(unix()))
    print(json.dumps({{t: {{how: attempt(t, how) for how in ("key_value_set", "connect")}}
                      for t in targets}}))
    """


def test_a_neighbour_reaches_no_coordinator_of_a_jax_session_and_it_still_works(two_users):
    m = two_users
    book = m.notebook(m.victim)
    try:
        started = book.run("%xla_session start --runtime jax -n 2")
        assert started["ok"], started
        first = book.run("""
            %%xla_spawn --no-widget
            import numpy as np
            from jax.experimental import multihost_utils
            multihost_utils.process_allgather(np.array([index]))
            """)  # (gloo's pairs made: its listeners are up)
        assert first["ok"], first
        attack = m.python(m.attacker, ATTACKER.format(uid=m.victim.uid), timeout=180)
        tried = json.loads(attack.stdout.strip().splitlines()[-1])
        # The session still works, and holds no key of the attacker's.
        after = book.run("""
            %%xla_spawn --no-widget -o got
            from jax._src import distributed
            try:
                planted = distributed.global_state.client.key_value_try_get("colab_xla_attack")
            except Exception:  # (not found)
                planted = None
            (int(multihost_utils.process_allgather(np.array([index + 1])).sum()), planted)
            """, then="got")
        book.run("%xla_session stop")
    finally:
        book.close()
    assert tried, "the attacker found no listening socket of the victim's"  # (gloo's at least)
    # (a connect as task 1 can end the session without its own client seeing an answer:
    # the session's next cell says so)
    reached = {t: hows for t, hows in tried.items() if "reached" in hows.values()}
    assert (reached, after["value"]) == ({}, {"0": [3, None], "1": [3, None]}), (
        textwrap.shorten(json.dumps(tried), 2000), after["err"][-2000:])
