"""Imported by Python at start-up when a test puts this folder on PYTHONPATH (devkit.faults.faults_env)."""

import os

if any(name.startswith("HSX_TEST_") for name in os.environ):
    from devkit.faults import install

    install(os.environ)
