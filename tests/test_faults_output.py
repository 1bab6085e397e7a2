"""Output faults of issue #12 in a real kernel: what a replica displays."""

from __future__ import annotations

import pytest

from _kernel import Kernel  # tests/ is on sys.path

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300), pytest.mark.stacks("colab")]

PNG = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00"
       b"\x00\x1f\x15\xc4\x89\x00\x00\x00\rIDATx\x9cc\xf8\xff\xff?\x00\x05\xfe\x02\xfe\xa7"
       b"5\x81\x84\x00\x00\x00\x00IEND\xaeB`\x82")


def test_display_in_a_replica_shows_text_forms_in_the_text_view_and_says_where_it_is_drawn():
    with Kernel() as k:
        assert k.run("%load_ext colab_xla").status == "ok"
        reply = k.run(
            "%%xla_spawn -n 2 --no-widget\n"
            "from IPython.display import display, Image, HTML\n"
            "display({'replica': index})\n"
            f"for _ in range(3):\n    display(Image(data={PNG!r}, format='png'))\n"
            "display(HTML('<b>bold</b>'))\n"
            "print('after', index)")
        assert reply.status == "ok", reply.text
        text = reply.text
        for o in range(2):
            assert f"[replica {o}] {{'replica': {o}}}" in text, text
            assert f"[replica {o}] after {o}" in text, text
            assert text.count(f"[replica {o}] [an image: image/png]") == 3, text
            assert text.count(f"[replica {o}] (displayed image/png: the widget view") == 3
            assert f"[replica {o}] [a display: text/html]" in text, text
        assert "IPython.core.display" not in text  # no useless default reprs
        assert "not shown" not in text  # (only a widget is not)
