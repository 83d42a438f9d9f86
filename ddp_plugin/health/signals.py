"""Lightning's SIGTERM handler kept from replacing a diagnosis with its own failed collective."""

from __future__ import annotations

import signal
import threading

from ddp_plugin.health.diagnosis import is_communication_error


def shield_sigterm_handler() -> None:
    """Keep the SIGTERM handler in place (Lightning's notifier broadcasts to the other ranks) from replacing a
    diagnosis with its own failed collective. torchrun SIGTERMs the survivors of a dead rank; arriving while a
    survivor diagnoses the failure (or just before), the handler's broadcast fails too, and its raw gloo error
    used to be what the survivor raised. The shielded handler lets a communication error of the handler pass:
    the collective this rank is in (or its next) fails as well and names the rank at fault. Call it on the main
    thread once the Trainer has installed its handlers (the strategy does, at the first training step)."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if not callable(current) or getattr(current, "_ddp_plugin_shield", False):
        return

    def shielded(signum: int, frame: object) -> None:
        try:
            current(signum, frame)
        except Exception as err:
            if not is_communication_error(err):
                raise

    shielded._ddp_plugin_shield = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, shielded)
