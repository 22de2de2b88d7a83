"""The chat page at /, in a real browser (headless Chromium from the system's packages, driven
by selenium): a message typed and sent comes back as the model's streamed answer."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loom import LLM, SamplingParams
from serving import ThreadedServer

HOUSE = Path(__file__).resolve().parents[1] / "models" / "house"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                    reason="needs chromium and chromedriver on PATH (Debian: apt-get install chromium "
                           "chromium-driver; .ci/run installs them)")
def test_chat_page_streams_an_answer(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    llm = LLM(str(HOUSE))
    want = llm.chat([{"role": "user", "content": "Who is JULIET?"}], SamplingParams(temperature=0, max_tokens=24),
                    use_tqdm=False)[0].outputs[0].text
    server = ThreadedServer(llm)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        browser.get(server.url + "/")
        WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text == "house")
        for field, value in (("temperature", "0"), ("max_tokens", "24")):
            element = browser.find_element(By.ID, field)
            element.clear()
            element.send_keys(value)
        browser.find_element(By.ID, "input").send_keys("Who is JULIET?")
        browser.find_element(By.ID, "send").click()
        answer = WebDriverWait(browser, 60).until(lambda b: b.find_elements(By.ID, "answer-1"))[0]
        # the page appends the answer to the conversation once the stream has ended
        WebDriverWait(browser, 60).until(lambda b: b.execute_script("return messages.length") == 2)
        browser.save_screenshot(str(tmp_path / "chat.png"))
        assert answer.get_attribute("class") == "msg assistant"
        assert answer.get_attribute("textContent") == want
        assert server.idle()
    finally:
        browser.quit()
        server.stop()
