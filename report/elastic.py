"""What a run with checkpoints and restarts says after its table: each interruption and what it cost (torch-free)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.markup import escape


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} samples/s"


def says_losses(record: Mapping[str, Any]) -> bool:
    """Whether the elastic summary lists the losses (a run interrupted or resumed: every step's, across attempts)."""
    elastic = record.get("elastic")
    return bool(elastic and (elastic["interruptions"] or elastic["first_step"]))


def elastic_lines(record: Mapping[str, Any]) -> list[str]:
    """One line per interruption (lost devices, detect, stop, re-plan, reload, steps lost, throughput before and
    after), the loss of every step across them, and where the checkpoints are (rich markup: plans are escaped)."""
    elastic = record.get("elastic")
    if not elastic:
        return []
    lines = []
    for event in elastic["interruptions"]:
        lines.append(
            f"interrupted: lost rank(s) {', '.join(map(str, event['lost_ranks']))} ({'; '.join(event['lost_devices'])})"
            f"{'' if event['died_at_step'] is None else ' as step ' + str(event['died_at_step'] + 1) + ' started'}; "
            "detected in "
            f"{_seconds(event['detect_s'])}, survivors stopped in {_seconds(event['stop_survivors_s'])}, re-planned "
            f"for {event['devices_after']} devices in {_seconds(event['replan_s'])} ({escape(event['plan_after'])}), "
            + (
                f"reloaded the state after step {event['resumed_from_step']} in {_seconds(event.get('reload_s'))} "
                f"({_seconds(event.get('respawn_to_loaded_s'))} from respawn)"
                if event.get("checkpoint")
                else "restarted from the seed's weights (no checkpoint was complete)"
            )
            + f", {event['steps_lost']} step(s) lost; "
            f"throughput {_rate(event['throughput_before_samples_per_s'])} before, "
            f"{_rate(event.get('throughput_after_samples_per_s'))} after"
        )
    losses = elastic["losses_by_step"]
    if says_losses(record):
        first = elastic["first_step"]
        lines.append(f"loss per step from step {first + 1}: " + ", ".join(f"{loss:.4f}" for loss in losses))
    saved = elastic["checkpoints_saved_last_attempt"]
    if saved:
        written = f", written in {_seconds(elastic['write_s'])} in the background" if elastic.get("write_s") else ""
        on_disk = elastic.get("checkpoints_on_disk")  # (records from before it: what the last attempt saved)
        kept = (
            f"steps {', '.join(map(str, on_disk))} on disk, the last attempt saved {', '.join(map(str, saved))}"
            if on_disk is not None
            else f"steps {', '.join(map(str, saved))} saved by the last attempt"
        )
        waited = _seconds(elastic["save_s"])
        lines.append(
            f"checkpoints: {escape(elastic['checkpoint_dir'])} ({kept}; the slowest rank waited {waited} to "
            f"save{written})"
        )
    return lines
