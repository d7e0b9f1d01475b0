"""Diagnosis: detectors over the timeline that say what is wrong, with the numbers and the lever to pull
(`detectors.diagnose`, `findings.Finding`, `findings.Window`)."""
