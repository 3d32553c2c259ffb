"""Whose cloud this machine runs on, by its DMI data (the firmware's vendor, product and BIOS
names): a cloud's notice source starts only where its endpoint variable is set or this says so."""

from __future__ import annotations

from pathlib import Path

_DMI = Path("/sys/class/dmi/id")


def dmi_says(*needles: str) -> bool:
    """Whether the vendor, product or BIOS name holds any of `needles` (``Amazon``, ``Google``)."""
    for name in ("sys_vendor", "product_name", "bios_vendor"):
        try:
            text = (_DMI / name).read_text()
        except OSError:
            continue
        if any(n in text for n in needles):
            return True
    return False


def dmi_value(name: str) -> str | None:
    """One DMI field (``chassis_asset_tag``), stripped; None where it cannot be read."""
    try:
        return (_DMI / name).read_text().strip()
    except OSError:
        return None
