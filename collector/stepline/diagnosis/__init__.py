"""Diagnosis: detectors over the timeline that say what is wrong, with the numbers and the lever to pull."""

from stepline.diagnosis.engine import DETECTORS, as_json, diagnose, render, summary_for_demo
from stepline.diagnosis.findings import Finding, Window

__all__ = ["DETECTORS", "Finding", "Window", "as_json", "diagnose", "render", "summary_for_demo"]
