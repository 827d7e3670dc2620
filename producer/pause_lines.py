"""``status``'s text lines for a paused run, from any pause record a role may have written.

A pause record is read from storage or Redis (any generate worker writes one); its schema holds
what honest writers write, and these lines read each field as far as the record holds it.
"""

from __future__ import annotations

from collections.abc import Mapping


def pause_lines(pause: Mapping[str, object], gates: Mapping[str, object]) -> list[str]:
    """Why the run paused: the window that tripped and examples, each field as far as the record
    holds it (an old or hand-written record lacks some: shown as '?', never a crash)."""
    found = pause.get("window")
    window = found if isinstance(found, dict) else {}
    lines = [f"  PAUSED  {pause.get('reason', '?')}"]
    if window:
        lines.append(f"    window that tripped: {window.get('rejected', '?')}/"
                     f"{window.get('size', '?')} rejected ({_share(window.get('rate'))}; limit "
                     f"{_share(window.get('max_reject_rate'))} over {window.get('limit', '?')});"
                     f" whole run so far {_share(gates.get('rate'), '.1%')}")
    examples = pause.get("examples")
    for e in examples if isinstance(examples, list) else []:
        if not isinstance(e, dict):
            continue
        reasons = e.get("reasons")
        shown = ", ".join(map(str, reasons)) if isinstance(reasons, list) else "?"
        lines.append(f"    e.g. {e.get('id', '?')}: {shown}: {str(e.get('answer', ''))[:80]!r}")
    return lines


def _share(value: object, spec: str = ".0%") -> str:
    """A rate as a percentage, or '?' where the record holds no number."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return format(value, spec) if ok else "?"
