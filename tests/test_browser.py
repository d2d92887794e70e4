"""The browser page in a real browser: Debian's Chromium driven by Playwright, its microphone a
spoken WAV (Chromium's fake capture device), against a real `vc-serve`."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("fastapi")
sync_api = pytest.importorskip("playwright.sync_api")

from serving import vc_serve  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with vc_serve(tiny_checkpoint) as base:
        yield base


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_the_page_talks_to_the_model(server, spoken_wav):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={spoken_wav}", "--autoplay-policy=no-user-gesture-required",
            "--no-sandbox"])
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server + "/")
            assert page.title() == "voicechat"
            page.fill("#prompt", "Be concise.")
            page.click("#start")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('connected')",
                                   timeout=60_000)
            # The model answers while it listens: text arrives and audio plays before the user stops.
            page.wait_for_function("document.getElementById('text').textContent.length > 0", timeout=120_000)
            page.wait_for_function("window.voicechat.played > 0", timeout=120_000)
            page.click("#mute")
            assert page.text_content("#mute") == "Unmute"
            page.click("#stop")
            page.wait_for_function("document.getElementById('status').textContent === 'answer done'",
                                   timeout=120_000)
            assert page.text_content("#transcript")  # the user's words as the model heard them
            assert page.evaluate("window.voicechat.received") >= page.evaluate("window.voicechat.played") > 0
            assert not page.text_content("#error") and not errors
        finally:
            browser.close()
