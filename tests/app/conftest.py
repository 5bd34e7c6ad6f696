"""The page's tests run it with Streamlit's AppTest, whose first run of each page scans the
metadata of every installed distribution for Streamlit components: some half a second a page,
most of the time of a short test. The installed packages do not change while the tests run, so
here the scan is made once a process and its answer handed to every page."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def streamlit_components_scanned_once():
    try:
        from streamlit.components.v2 import manifest_scanner
    except ImportError:  # a Streamlit without the scan: nothing to spare
        yield
        return
    scan = manifest_scanner.scan_component_manifests
    found = scan()
    manifest_scanner.scan_component_manifests = lambda *args, **kwargs: list(found)
    yield
    manifest_scanner.scan_component_manifests = scan
