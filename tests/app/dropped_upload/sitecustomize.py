"""Loaded by the test server of test_app_browser.py (its PYTHONPATH names this folder): when the
file $CAPTIONER_TEST_DROP_UPLOAD exists, the session's next rerun request that holds uploaders'
values loses them, and the file is deleted. That is the run Streamlit sometimes starts when an
upload lands just as the last run ends: without the new uploader's value."""

import os
from pathlib import Path

FLAG = os.environ.get("CAPTIONER_TEST_DROP_UPLOAD")

if FLAG:
    from streamlit.runtime import app_session

    _request_rerun = app_session.AppSession.request_rerun

    def request_rerun(self, client_state):
        flag = Path(FLAG)
        if client_state is not None and flag.exists():
            widgets = client_state.widget_states.widgets
            kept = [w for w in widgets if w.WhichOneof("value") != "file_uploader_state_value"]
            if len(kept) < len(widgets):
                flag.unlink()
                del widgets[:]
                widgets.extend(kept)
        return _request_rerun(self, client_state)

    app_session.AppSession.request_rerun = request_rerun
