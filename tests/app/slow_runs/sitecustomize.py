"""Loaded by the test server of test_app_browser.py (its PYTHONPATH names this folder): while the
file $CAPTIONER_TEST_SLOW_RUNS exists, every script run waits as many seconds as the file says
after the widgets' callbacks and before the script itself starts (before its first element
reaches the browser), and says so by creating the file named like it with ".waiting" added. That holds the
page as it is in the moment between an upload's rerun request and its run's first element: the
moment a person's next upload may land in."""

import os
import time
from pathlib import Path

FLAG = os.environ.get("CAPTIONER_TEST_SLOW_RUNS")

if FLAG:
    from streamlit.runtime.state.session_state import SessionState

    _on_script_will_rerun = SessionState.on_script_will_rerun

    def on_script_will_rerun(self, *args, **kwargs):
        done = _on_script_will_rerun(self, *args, **kwargs)
        flag = Path(FLAG)
        try:
            wait = float(flag.read_text() or "0")
        except (OSError, ValueError):
            wait = 0.0
        if wait > 0:
            Path(f"{FLAG}.waiting").touch()
            time.sleep(wait)
        return done

    SessionState.on_script_will_rerun = on_script_will_rerun
