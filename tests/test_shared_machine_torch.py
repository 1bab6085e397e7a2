"""What another local user can do to the stores and sockets where a run's processes meet:
two real Unix users on one machine (tests/_two_users.py). While the victim's cell waits
(its group made), the attacker finds every socket the victim listens on (``/proc/net/tcp``
and ``tcp6`` name each socket's owner to every user) and tries each as a torch
``TCPStore``, which has no authentication: set a key, read it back. He must reach no store
of the victim's, and the victim's cell must end as it would have, with no key of his in its
store. (Gloo's loopback listeners are the victim's sockets he finds: a store client of one
gets no answer, and the victim's collectives go on.)
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from _listeners import TCP_LISTENING  # tests/ is on sys.path

pytestmark = [pytest.mark.shared_machine, pytest.mark.timeout(600)]

KEY = "colab_xla-attack"

# The attacker's side: every listening socket of the victim's, tried as a TCPStore.
ATTACK = TCP_LISTENING + """
import datetime, json, os, threading, time
import torch.distributed as dist

def listening(uid):
    return _tcp_listening(lambda fields: int(fields[7]) == uid)  # the victim's

def attempt(host, port, out):
    try:
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=datetime.timedelta(seconds=3))
        store.set(KEY, "his")
        out.append(store.get(KEY) == b"his")  # (a store answers; anything else does not)
    except Exception as exc:  # noqa: BLE001 - every way of not reaching a store
        out.append(type(exc).__name__)

tried = []
for address, port in listening(VICTIM):
    host = "127.0.0.1" if address in ("0.0.0.0", "::") else address.removeprefix("::ffff:")
    out = []  # (a client of gloo's listener waits for an answer that never comes)
    threading.Thread(target=attempt, args=(host, port, out), daemon=True).start()
    deadline = time.monotonic() + 10
    while not out and time.monotonic() < deadline:
        time.sleep(0.05)
    tried.append([address, port, out[0] if out else "no answer"])
print(json.dumps(tried), flush=True)
os._exit(0)  # (not waiting for the clients that got no answer)
"""


def _wait_for(paths, proc, ran, seconds: float) -> None:
    """Until every path of ``paths`` exists (the victim's replicas made them), or fail:
    the victim's notebook or cell ended (``ran``), or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths):
        assert not ran, f"the victim's cell ended before it waited: {ran}"
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, f"the victim's replicas never got to {paths}"
        time.sleep(0.1)


def _attack_while_waiting(m, cell: str, replicas: int):
    """Run ``cell`` in the victim's notebook (``-o outs``); once each replica wrote its
    ``ready-INDEX`` file in the victim's home, the attacker tries every socket of the
    victim's, then ``go`` lets the cell go on. Returns (what he tried, the cell's run)."""
    v = m.victim
    book = m.notebook(v)
    try:
        ran = []
        runner = threading.Thread(target=lambda: ran.append(book.run(cell, then="outs")),
                                  daemon=True)
        runner.start()
        _wait_for([f"{v.home}/ready-{i}" for i in range(replicas)], book.proc, ran, 300)
        attack = m.python(m.attacker, f"VICTIM = {v.uid}\nKEY = {KEY!r}\n" + ATTACK,
                          timeout=300)
        with open(f"{v.home}/go", "w"):
            pass
        runner.join(300)
        assert ran, "the victim's cell did not end"
        return json.loads(attack.stdout.strip().splitlines()[-1]), ran[0]
    finally:
        book.close()


WAITS = """
import os, time
open(os.path.join(os.environ["HOME"], f"ready-{index}"), "w").close()
while not os.path.exists(os.path.join(os.environ["HOME"], "go")):
    time.sleep(0.05)
"""


def test_no_store_of_a_torch_runtime_run_is_reachable_by_another_user(two_users):
    m = two_users
    cell = ("%%xla_spawn --runtime torch -n 2 -o outs\n"
            "import torch, torch.distributed as dist\n"
            "t = torch.ones(1)\ndist.all_reduce(t)  # (the group made, gloo connected)\n"
            + WAITS +
            "store = dist.distributed_c10d._get_default_store()\n"
            "while isinstance(store, dist.PrefixStore):\n"
            "    store = store.underlying_store\n"
            "u = torch.tensor([float(index + 1)])\ndist.all_reduce(u)\n"
            f"(u.item(), store.check([{KEY!r}]))\n")
    tried, ran = _attack_while_waiting(m, cell, 2)
    assert tried, "the victim listened on nothing: nothing was tried"  # (gloo's, at least)
    assert [t for t in tried if t[2] is True] == [], tried
    assert ran["ok"], ran
    assert ran["value"] == {"0": [3.0, False], "1": [3.0, False]}, ran


def test_no_store_of_a_simulation_run_with_collectives_is_reachable_by_another_user(
        two_users):
    m = two_users
    cell = ("%%xla_spawn -n 2 -o outs\n"
            "import torch, torch_xla.core.xla_model as xm\n"
            "t = torch.ones(1, device=device)\n"
            "xm.all_reduce(xm.REDUCE_SUM, [t], groups=[[0], [1]])  # (gloo's groups)\n"
            "xm.all_reduce(xm.REDUCE_SUM, t).item()\n"
            + WAITS +
            "u = torch.tensor([float(index + 1)], device=device)\n"
            "(xm.all_reduce(xm.REDUCE_SUM, u).item(),\n"
            " xm.all_reduce(xm.REDUCE_SUM, [u], groups=[[0], [1]])[0].item())\n")
    tried, ran = _attack_while_waiting(m, cell, 2)
    assert [t for t in tried if t[2] is True] == [], tried
    assert ran["ok"], ran
    assert ran["value"] == {"0": [3.0, 1.0], "1": [3.0, 2.0]}, ran
