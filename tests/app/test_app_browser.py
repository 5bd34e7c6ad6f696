"""The web page in a real browser: a Streamlit server, Chromium driven by Playwright.

Needs Debian's chromium-headless-shell (or, failing that, its chromium) and the playwright
package (its own browser downloads are never used). The headless shell is Chromium's page
engine without the browser around it: the same page, about a fifth less CPU for these tests
(docs/testing.md). The screenshots go to $CAPTIONER_SCREENSHOT and
$CAPTIONER_DEMO_SCREENSHOT (default: a temporary folder) so a person can look at the page;
docs/app-demo.png is the second one.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from captioner.cli.main import main
from captioner.io import bundled
from tests.builders import free_port
from tests.tiny import tiny_captioner, tiny_image

# Debian's headless shell, else its whole browser.
CHROMIUM = next((p for p in (Path("/usr/lib/chromium/chromium-headless-shell"), Path("/usr/bin/chromium"))
                 if p.is_file()), Path("/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
APP = Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py"
MODEL = "tiny.pt"
# The page's uploader; during a script run the one it replaced may linger, marked stale.
UPLOADER = ".stElementContainer:not([data-stale=true]) input[type=file]"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,  # a Streamlit server and Chromium: the whole suite runs them, the fast tier does not
    pytest.mark.skipif(not CHROMIUM.is_file(), reason="needs Debian's chromium-headless-shell or chromium"),
]
sync_api = pytest.importorskip("playwright.sync_api")


def _stop(proc: subprocess.Popen) -> None:
    """End a server started by a fixture: terminate, then kill if it lingers."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"streamlit exited with {server.returncode}:\n{log.read_text(errors='replace')}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"streamlit did not answer within {timeout:.0f} s:\n{log.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("weights")
    tiny_captioner(seed=5).save(folder / MODEL)
    return folder


@pytest.fixture(scope="module")
def served(weights_dir, tmp_path_factory):
    """(address, server process, run log, flag file): the page served as `captioner app` serves it,
    on a free local port; always stopped afterwards. While the flag file exists, its script runs
    wait before they start (tests/app/slow_runs/sitecustomize.py); without it they run as the
    app's do."""
    from captioner.app.cli import server_env, streamlit_command

    workdir = tmp_path_factory.mktemp("server")
    log, flag = workdir / "streamlit.log", workdir / "slow-runs"
    port = free_port()
    env = server_env(base={**os.environ, "CAPTIONER_WEIGHTS_DIR": str(weights_dir),
                           "CAPTIONER_APP_RUN_LOG": str(workdir / "runs.log"),
                           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "slow_runs"),
                                                          *filter(None, [os.environ.get("PYTHONPATH")])]),
                           "CAPTIONER_TEST_SLOW_RUNS": str(flag)})
    cmd = streamlit_command(port, "127.0.0.1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log)
        yield url, proc, workdir / "runs.log", flag
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(server)
    # Select the tiny model: bundled demo models, when installed, are listed first.
    page.get_by_test_id("stSidebar").get_by_test_id("stSelectbox").click()
    page.get_by_role("option", name=MODEL, exact=True).click()
    page.get_by_text(f" · {MODEL} · beam ").wait_for()
    _wait_idle(page)
    try:
        yield page
    finally:
        context.close()


def _upload(page, path: Path) -> None:
    page.locator(UPLOADER).set_input_files(str(path))


def _wait_idle(page) -> None:
    """Until the script run has finished: no running indicator, no stale elements left from the last run."""
    page.wait_for_function(
        "() => !document.querySelector('[data-testid^=stStatusWidgetRunning], [data-stale=true]')")


def _screenshot(page, path: Path) -> None:
    # Streamlit scrolls inside its main section, so a "full page" shot would stop at the
    # viewport: grow the viewport to the content instead.
    height = page.evaluate(
        "() => Math.max(...[...document.querySelectorAll("
        "'[data-testid=stMain], [data-testid=stMainBlockContainer], [data-testid=stAppViewContainer]')]"
        ".map(e => e.scrollHeight))")
    page.set_viewport_size({"width": page.viewport_size["width"], "height": int(height) + 40})
    page.wait_for_function("() => [...document.images].every(img => img.complete)")
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)


def test_upload_in_the_browser_shows_the_cli_caption(page, weights_dir, tmp_path, capsys):
    image = tmp_path / "browser-upload.png"
    tiny_image(7, (96, 64)).save(image)
    capsys.readouterr()
    assert main(["caption", str(image), "--weights", str(weights_dir / MODEL), "--beam-size", "3",
                 "--max-len", "20", "--quiet"]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = cli["caption"]

    _upload(page, image)
    details = page.get_by_text(f"{image.name} · {MODEL} · beam 3")
    details.wait_for()
    _wait_idle(page)
    shown = page.locator(".st-key-caption h2").inner_text().strip()
    assert shown == expected
    assert f"log-probability {cli['score']:.2f}" in details.inner_text()
    panels = page.locator("label.cell")  # the grid's panels, one per word
    assert panels.count() == len(expected.split())
    assert [p.split(" · β ")[0] for p in panels.all_inner_texts()] == expected.split()
    assert page.get_by_test_id("stException").count() == 0

    shot = Path(os.environ.get("CAPTIONER_SCREENSHOT") or tmp_path / "app.png")
    _screenshot(page, shot)
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000


def test_a_broken_upload_shows_an_error_not_a_traceback(page, tmp_path):
    bad = tmp_path / "not-a-photo.jpg"
    bad.write_bytes(b"just some text, not an image\n")
    _upload(page, bad)
    error = page.get_by_test_id("stAlertContentError")
    error.wait_for()
    _wait_idle(page)
    assert "not an image" in error.inner_text()
    assert page.get_by_test_id("stException").count() == 0

    good = tmp_path / "after.png"
    buf = io.BytesIO()
    tiny_image(8, (64, 64)).save(buf, "PNG")
    good.write_bytes(buf.getvalue())
    _upload(page, good)
    page.get_by_text(f"{good.name} · {MODEL} · beam 3").wait_for()
    assert page.get_by_test_id("stAlertContentError").count() == 0


@pytest.mark.skipif(not (bundled.DEMOS["demo-soft"].path).is_file(),
                    reason="the bundled demo model is not installed")
@contextmanager
def _fresh_page(browser, server):
    """A page in a context of its own (1400 px wide) on the app, demo-soft's first example captioned."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
    try:
        page = context.new_page()
        page.set_default_timeout(90_000)
        page.goto(server)
        page.get_by_text(" · demo-soft · beam ").wait_for()
        yield page
    finally:
        context.close()


def _screenshot_when_drawn(page, env: str, fallback: Path) -> None:
    """Once the word picker and every map are drawn: the whole page to the file $``env`` names,
    else ``fallback`` (the file named on stdout)."""
    shot = Path(os.environ.get(env) or fallback)
    page.locator("label.cell").first.wait_for()
    page.wait_for_function("() => !document.querySelector('[data-testid=stSkeleton]')")
    _screenshot(page, shot)
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000


def test_the_demo_model_shows_its_notice_in_the_browser(browser, server, tmp_path):
    with _fresh_page(browser, server) as page:  # the default model, demo-soft, its first example
        _wait_idle(page)
        notice = page.get_by_test_id("stAlertContentWarning").filter(has_text="trained on synthetic shapes only")
        assert notice.count() == 1 and notice.is_visible()
        caption_box = page.locator(".st-key-caption").bounding_box()
        notice_box = notice.bounding_box()
        assert 0 <= notice_box["y"] - (caption_box["y"] + caption_box["height"]) < 150  # right under the caption
        card = page.get_by_test_id("stSidebar").locator(".st-key-model_card")
        assert "Trained on: synthetic shapes only" in card.inner_text()

        _screenshot_when_drawn(page, "CAPTIONER_DEMO_SCREENSHOT", tmp_path / "app-demo.png")


@pytest.mark.skipif(not (bundled.DEMOS["demo-zh"].path).is_file(),
                    reason="the bundled Chinese demo model is not installed")
def test_the_chinese_demo_captions_in_chinese_in_the_browser(browser, server, tmp_path):
    """demo-zh picked in the sidebar: the first example's caption in Chinese characters without
    spaces, its word picker one character a pill. The screenshot is docs/app-demo-zh.png."""
    import re

    with _fresh_page(browser, server) as page:
        page.get_by_test_id("stSidebar").get_by_test_id("stSelectbox").click()
        page.get_by_role("option", name="demo-zh", exact=True).click()
        page.get_by_text(" · demo-zh · beam ").wait_for()
        _wait_idle(page)
        caption = page.locator(".st-key-caption").inner_text().strip()
        assert re.fullmatch(r"[\u4e00-\u9fff]{6,}", caption), caption  # characters, no spaces
        _screenshot_when_drawn(page, "CAPTIONER_DEMO_ZH_SCREENSHOT", tmp_path / "app-demo-zh.png")


@pytest.mark.skipif(not (bundled.DEMOS["demo-soft"].path).is_file(),
                    reason="the bundled demo model is not installed")
def test_the_maps_toggle_shows_the_gradient_maps_in_the_browser(browser, server, tmp_path):
    """"What made it say it" clicked above demo-soft's first example: the same caption and word
    picker, the grid's heading says what the maps show now. The screenshot is docs/app-explain.png."""
    with _fresh_page(browser, server) as page:
        _wait_idle(page)
        page.locator("label.cell").first.wait_for()  # the word picker and the grid drawn
        caption = page.locator(".st-key-caption").inner_text().strip()
        words = page.locator("label.cell").count()
        assert page.get_by_text("Every word, where the model looked").count() == 1
        page.get_by_text("What made it say it (gradient × input)").click()
        page.get_by_text("Every word, what made the model say it").wait_for()
        _wait_idle(page)
        assert page.locator(".st-key-caption").inner_text().strip() == caption
        assert page.locator("label.cell").count() == words
        assert page.get_by_test_id("stException").count() == 0
        _screenshot_when_drawn(page, "CAPTIONER_EXPLAIN_SCREENSHOT", tmp_path / "app-explain.png")


PHOTO = Path(__file__).parents[1] / "fixtures" / "photos" / "coco" / "train2014" / "COCO_train2014_000000000009.jpg"


@pytest.mark.skipif(not (bundled.DEMOS["demo-soft"].path).is_file(),
                    reason="the bundled demo model is not installed")
def test_a_photograph_is_flagged_unfamiliar_beside_the_notice_in_the_browser(browser, server, tmp_path):
    with _fresh_page(browser, server) as page:  # demo-soft, the first example: shapes, familiar
        _wait_idle(page)
        unlike = page.get_by_test_id("stAlertContentWarning").filter(has_text="unlike the pictures")
        assert unlike.count() == 0
        _upload(page, PHOTO)
        page.get_by_text(f"{PHOTO.name} · demo-soft · beam ").wait_for()
        _wait_idle(page)
        assert unlike.count() == 1 and unlike.is_visible() and "familiarity 0.000" in unlike.inner_text()
        notice = page.get_by_test_id("stAlertContentWarning").filter(has_text="trained on synthetic shapes only")
        assert notice.count() == 1  # the fixed notice stays
        shaded = page.locator(".captioner-probs .word-prob")
        assert shaded.count() == len(page.locator(".st-key-caption h2").inner_text().split())
        assert shaded.first.get_attribute("title").startswith("p = ")
        _screenshot_when_drawn(page, "CAPTIONER_PHOTO_SCREENSHOT", tmp_path / "app-photo.png")


LOCAL_HOSTS = {"127.0.0.1", "localhost"}


def _outside(urls: list[str]) -> list[str]:
    """The requests that left the machine: any host but the app's own (data: and blob: stay in the page)."""
    from urllib.parse import urlsplit

    return [u for u in urls if urlsplit(u).scheme not in ("data", "blob") and urlsplit(u).hostname not in LOCAL_HOSTS]


def test_the_page_asks_nothing_of_any_other_host(browser, server, tmp_path):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, device_scale_factor=1,
                                  accept_downloads=True)
    requests: list[str] = []
    context.on("request", lambda request: requests.append(request.url))
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(server)
        page.get_by_text(" · beam ").wait_for()  # the first example, captioned
        page.get_by_test_id("stSidebar").get_by_test_id("stSelectbox").click()
        page.get_by_role("option", name=MODEL, exact=True).click()
        page.get_by_text(f" · {MODEL} · beam ").wait_for()
        _wait_idle(page)
        image = tmp_path / "local-only.png"
        tiny_image(9, (80, 60)).save(image)
        _upload(page, image)
        page.get_by_text(f"{image.name} · {MODEL} · beam 3").wait_for()
        _wait_idle(page)
        page.locator("label.cell").first.wait_for()
        page.wait_for_function("() => [...document.images].every(img => img.complete)")

        # The figure is made on the click, and is the page's figure.
        with page.expect_download() as download:
            page.get_by_role("button", name="Download the figure (PNG)").click()
        png = Path(download.value.path()).read_bytes()
        assert png.startswith(b"\x89PNG") and download.value.suggested_filename == "local-only-attention.png"
        page.wait_for_timeout(500)  # anything the page asks for late
    finally:
        context.close()
    assert len(requests) > 5  # the page, its scripts, its images: recorded
    assert _outside(requests) == []


def test_a_long_session_keeps_the_server_memory_level(page, served, tmp_path):
    """Many distinct uploads in one session: the server's memory stops growing. The pictures are
    1120x840, so that a server keeping each upload's decoded picture (2.8 MB) grows by some 40 MB
    over the last three quarters of the session, past the 24 MB allowance (it grew 38 MB over
    those 15 uploads where it was tried, 1 MB without it). Each upload costs the browser and the
    server about as much whatever the picture's size, so a few large ones show a leak for less
    than many small ones did. CAPTIONER_LONG_SESSION_UPLOADS=500 for a longer session."""
    import psutil

    server = psutil.Process(served[1].pid)
    uploads = int(os.environ.get("CAPTIONER_LONG_SESSION_UPLOADS", "20"))
    deadline = time.monotonic() + 300
    rss = []
    for i in range(uploads):
        image = tmp_path / f"long-{i}.png"
        tiny_image(1000 + i, (1120, 840)).save(image)
        _upload(page, image)
        page.get_by_text(f"{image.name} · {MODEL} · beam 3").wait_for()
        image.unlink()
        rss.append(server.memory_info().rss)
        assert time.monotonic() < deadline, f"only {i + 1} uploads in 300 s"
    assert page.get_by_test_id("stException").count() == 0
    settled = rss[len(rss) // 4]  # after the first quarter: caches filled, arenas grown
    print(f"server memory: {rss[0] / 2**20:.0f} MiB after the first upload, {settled / 2**20:.0f} MiB after "
          f"{len(rss) // 4}, {max(rss) / 2**20:.0f} MiB at most, {rss[-1] / 2**20:.0f} MiB after {len(rss)}")
    assert rss[-1] < settled + 24 * 2**20 and max(rss[len(rss) // 4:]) < settled + 32 * 2**20


def _runs(served) -> list[str]:
    """What each script run of the server showed, in order (its run log)."""
    log = served[2]
    return [line.split("\t")[1] for line in log.read_text().splitlines()] if log.exists() else []


def test_each_upload_is_captioned_once_and_sends_only_its_file(page, served, tmp_path):
    """A new file replaces the last one in the one uploader: Streamlit runs the page once as it
    removes the last file (the page redraws the last picture, nothing captioned) and once with
    the new one; no other run, and no request but the file itself and the removal of the last."""
    requests: list[str] = []
    page.on("request", lambda request: requests.append(f"{request.method} {request.url}"))
    before = len(_runs(served))
    names = []
    for i in range(3):
        image = tmp_path / f"one-run-{i}.png"
        tiny_image(40 + i, (96, 64)).save(image)
        _upload(page, image)
        page.get_by_text(f"{image.name} · {MODEL} · beam 3").wait_for()
        _wait_idle(page)
        names.append(image.name)
    page.wait_for_timeout(500)  # a late run would show up here
    runs = _runs(served)[before:]
    assert [name for i, name in enumerate(runs) if i == 0 or runs[i - 1] != name] == names
    assert len(runs) <= 2 * len(names) - 1  # the first upload into an empty uploader: one run
    uploads = [r for r in requests if r.startswith("PUT ") and "/_stcore/upload_file/" in r]
    removed = [r for r in requests if r.startswith("DELETE ") and "/_stcore/upload_file/" in r]
    to_server = [r for r in requests if "/static/" not in r]  # the page's own code, loaded once
    assert len(uploads) == 3 and len(removed) <= 2
    assert sorted(to_server) == sorted(uploads + removed)  # the pictures are in the page
    stylesheets = page.evaluate(
        "() => [...document.querySelectorAll('style')].filter(s => s.textContent.includes('.captioner-result')).length")
    assert stylesheets == 1  # the page's stylesheet stays while uploads rerun the fragment, and only once


def _upload_with_the_button(page, path: Path) -> None:
    """As a person uploads: the uploader's own button, then the file in the browser's chooser."""
    with page.expect_file_chooser() as chooser:
        # The uploader holding a file shows its remove (or cancel) button there too.
        page.locator(".stElementContainer:not([data-stale=true]) [data-testid=stFileUploaderDropzone] "
                     "button:not([aria-label^=Remove]):not([aria-label^=Cancel])").click()
    chooser.value.set_files(str(path))


def test_many_uploads_in_a_row_each_show_their_own_caption(page, weights_dir, tmp_path, capsys):
    """Twelve distinct photos of 200-500 px, one after another in one session through the
    uploader's button, each once the last caption is shown and the page idle: every one
    shows its own file name and the caption the command line gives it."""
    folder = tmp_path / "many"
    folder.mkdir()
    rng = np.random.default_rng(12)
    paths = []
    for i in range(12):
        path = folder / f"photo-{i:02d}.jpg"
        tiny_image(300 + i, (int(rng.integers(200, 501)), int(rng.integers(200, 501)))).save(path, quality=90)
        paths.append(path)
    capsys.readouterr()
    assert main(["caption", str(folder), "--weights", str(weights_dir / MODEL), "--beam-size", "3",
                 "--max-len", "20", "--quiet"]) == 0
    expected = {Path(line["image"]).name: line["caption"]
                for line in map(json.loads, capsys.readouterr().out.strip().splitlines())}
    assert sorted(expected) == [p.name for p in paths]
    shown = []
    for path in paths:
        _upload_with_the_button(page, path)
        page.get_by_text(f"{path.name} · {MODEL} · beam 3").wait_for(timeout=30_000)
        _wait_idle(page)
        shown.append((path.name, page.locator(".st-key-caption h2").inner_text().strip()))
    assert shown == [(p.name, expected[p.name]) for p in paths]
    assert page.get_by_test_id("stException").count() == 0


def _shown_views(page) -> list[int]:
    """Which words' big views the page shows, by word index (a one-head model: one view per word)."""
    return page.locator(".big").evaluate_all("els => els.flatMap((e, t) => e.checkVisibility() ? [t] : [])")


def _drawn(page, selector: str) -> list[list[str]]:
    """The pictures each visible element of ``selector`` draws, top first (its CSS background images)."""
    return page.locator(selector).evaluate_all(
        "els => els.filter(e => e.checkVisibility())"
        ".map(e => getComputedStyle(e).backgroundImage.split(', ').map(u => u.slice(5, -2)))")


def test_picking_a_word_shows_its_map_and_asks_nothing_of_the_server(page, served, tmp_path):
    image = tmp_path / "pick.png"
    tiny_image(7, (96, 64)).save(image)
    _upload(page, image)
    page.get_by_text(f"{image.name} · {MODEL} · beam 3").wait_for()
    _wait_idle(page)
    words = page.locator(".st-key-caption h2").inner_text().split()
    assert len(words) >= 2
    note = page.locator(".note").filter(visible=True)
    assert _shown_views(page) == [0] and note.inner_text().startswith(f"“{words[0]}”: word 1 of")
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    runs = len(_runs(served))

    last = len(words) - 1
    page.locator(".word > .pill").nth(last).click()
    assert _shown_views(page) == [last]
    assert note.inner_text().startswith(f"“{words[last]}”: word {last + 1} of {len(words)}, β = ")
    view = page.locator(".big").filter(visible=True)
    assert view.bounding_box()["width"] > 100
    # The layer covers the photo exactly: both are the view's backgrounds, stretched to it.
    assert view.evaluate("e => getComputedStyle(e).backgroundSize") == "100% 100%, 100% 100%"
    ((layer, photo),) = _drawn(page, ".big")
    assert layer.startswith("data:image/png;base64,")
    assert photo.startswith("data:image/jpeg;base64,")  # drawn from the preview's definition
    page.locator("label.cell").nth(0).click()  # a panel of the grid picks its word too
    assert _shown_views(page) == [0]
    page.wait_for_timeout(500)
    assert requests == [] and len(_runs(served)) == runs


def test_the_head_picker_shows_the_picked_word_s_map_of_the_picked_head(browser):
    """A model with several heads: the result's HTML (as the page shows it, with the page's
    stylesheet) has a head picker, the mean first; the big view and the grid show the layer of
    the picked word and head."""
    from captioner.app.page import STYLE, Word, result_html
    from captioner.app.pictures import data_uri, png

    heads, n = 2, 3
    words = [Word(f"w{t}", f"note {t}", f"panel {t}") for t in range(n)]
    layers = {}
    for t in range(n):
        for j in (None, *range(heads)):  # each layer a distinct flat level, told apart by its src
            layers[(t, j)] = data_uri(png(np.full((4, 4), 10 * t + (0 if j is None else j + 1), np.uint8)),
                                      "image/png")
    photo = data_uri(png(np.zeros((4, 4), np.uint8)), "image/png")
    page = browser.new_page()
    try:
        page.set_content(STYLE + result_html("r1", words, layers, f"url({photo})", 1.0, (2, 2), heads))

        def expect(t, j):
            assert _drawn(page, ".big") == [[layers[(t, j)], photo]]
            panels = _drawn(page, "label.cell .pic")  # every word's panel, the picked head's layer
            assert panels == [[layers[(s, j)], photo] for s in range(n)]
            assert page.locator(".note").filter(visible=True).all_inner_texts() == [f"note {t}"]

        head_labels = page.locator(".heads label").filter(visible=True)
        word_pills = page.locator(".word > .pill").filter(visible=True)
        assert head_labels.all_inner_texts() == ["mean", "1", "2"]
        assert word_pills.all_inner_texts() == ["w0", "w1", "w2"]
        expect(0, None)
        head_labels.nth(2).click()  # head 2
        expect(0, 1)
        word_pills.nth(2).click()  # the third word, head 2 kept
        expect(2, 1)
        head_labels.nth(1).click()
        expect(2, 0)
        page.locator("label.cell").filter(visible=True).nth(1).click()  # a panel: its word, the head kept
        expect(1, 0)
        head_labels.nth(0).click()  # back to the mean
        expect(1, None)
    finally:
        page.close()


def test_an_upload_made_before_the_last_upload_s_run_draws_is_shown(browser, served, tmp_path):
    """A person's next upload may land after the last upload's rerun request and before its run
    draws anything, and its file may take longer to send than that run takes to start: here the
    run waits 3 s to start and the browser sends the next file in 5 s. The page kept in the
    uploader then must be the one the file arrives in: an uploader replaced by that run (a new
    key after every upload) dropped the file, no run ever came with it, and the page kept the
    previous picture (the uploads lost in docs/app-serving.md)."""
    url, flag = served[0], served[3]
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
    slow_sends = []

    def send(route):
        if route.request.method == "PUT" and slow_sends:
            time.sleep(slow_sends[0])  # a slow connection: the browser is sending the file meanwhile
        route.continue_()

    try:
        page = context.new_page()
        page.set_default_timeout(90_000)
        page.route("**/_stcore/upload_file/**", send)
        page.goto(url)
        page.get_by_test_id("stSidebar").get_by_test_id("stSelectbox").click()
        page.get_by_role("option", name=MODEL, exact=True).click()
        page.get_by_text(f" · {MODEL} · beam ").wait_for()
        _wait_idle(page)
        images = []
        for i in range(3):
            images.append(tmp_path / f"next-{i}.png")
            tiny_image(70 + i, (96, 64)).save(images[-1])
        _upload_with_the_button(page, images[0])
        page.get_by_text(f"{images[0].name} · {MODEL} · beam 3").wait_for()
        _wait_idle(page)

        waiting = Path(f"{flag}.waiting")
        flag.write_text("3")
        _upload_with_the_button(page, images[1])
        deadline = time.monotonic() + 30
        while not waiting.exists():  # a run is asked for (its own, or the one removing the last file), and waits
            assert time.monotonic() < deadline, "no run was asked for after the upload"
            page.wait_for_timeout(50)
        flag.unlink()  # the runs after this one start at once
        page.locator(f'.stElementContainer:not([data-stale=true]) [aria-label="Remove {images[1].name}"]'
                     ).wait_for(timeout=30_000)  # the file is sent, its rerun asked for
        slow_sends.append(5.0)
        _upload_with_the_button(page, images[2])  # into the uploader that holds the last file
        page.get_by_text(f"{images[2].name} · {MODEL} · beam 3").wait_for(timeout=40_000)
        _wait_idle(page)
        # Shown from the uploader it landed in, which still names it.
        assert page.locator(f'.stElementContainer:not([data-stale=true]) [aria-label="Remove {images[2].name}"]'
                            ).count() == 1
        assert page.get_by_test_id("stException").count() == 0
    finally:
        flag.unlink(missing_ok=True)  # the server's next runs, other tests', start at once
        context.close()
