"""The web chat page at `/` (openk3/serve/static), driven in headless Chromium through Selenium against a
live server over the nano model, the byte tokenizer and the scripted outputs of tests/serve_helpers.py.

The browser is the system's: Debian's `chromium` and `chromium-driver` (.ci/run installs them in CI).
Selenium is given both paths, so Selenium Manager never tries to download a driver. Without them the
tests skip, except under CI (the environment variable CI set), where they fail.

What the server saw is checked on the server: `prepare` of openk3.serve.chat is wrapped to record each
request body, and the engine loop's `submit` to record each rendered prompt (the engine itself runs in a
process of its own, as `openk3 serve` runs it by default).
"""

from __future__ import annotations

import json
import os

import pytest
from serve_helpers import byte_tokenizer, nano_model, script_engine, scripted_builder, served, wait_until

from openk3.infer.engine import Engine
from openk3.serve import chat, create_app

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # reported by the `browser` fixture: a skip locally, a failure under CI
    webdriver = None

MODEL = "nano-web"
KEY = "sekrit"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


# ---- the server, the browser ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    """(url, state, seen): a live server with an API key; seen["bodies"] / seen["prompts"] record what it got."""
    seen = {"bodies": [], "prompts": []}

    def recording_prepare(state, body):
        seen["bodies"].append(json.loads(json.dumps(body)))  # a copy: prepare rewrites messages in place
        return prepare(state, body)

    prepare = chat.prepare
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chat, "prepare", recording_prepare)
        app = create_app(scripted_builder(2), served_model_name=MODEL, api_key=KEY)  # the engine in its own process
        submit = app.state.openk3.loop.submit

        def recording_submit(requests, *args, **kwargs):
            # the byte ids of the prompt the engine runs: the rendered text
            seen["prompts"] += [bytes(i for i in prompt if i < 256) for _, prompt, _ in requests]
            return submit(requests, *args, **kwargs)

        app.state.openk3.loop.submit = recording_submit
        with served(app) as url:
            yield url, app.state.openk3, seen


def _browser_missing() -> str | None:
    if webdriver is None:
        return "selenium is not installed: pip install -e .[dev]"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(path) and os.access(path, os.X_OK)):
            return f"{path} is missing: apt-get install chromium chromium-driver"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = _browser_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests, but {missing}", pytrace=False)
        pytest.skip(missing)
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1000,760",
                "--no-first-run", "--disable-extensions", "--disable-background-networking", "--disable-sync",
                "--disable-component-update", "--force-prefers-reduced-motion"):
        options.add_argument(arg)
    # console messages, and the DevTools network events that show every request the page makes
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def open_page(driver, url: str, key: str | None = KEY, expect_model: bool = True):
    """A fresh page (empty conversation) with `key` as the stored API key; drains the logs of earlier pages."""
    driver.get(url + "/health")  # same origin, so the same localStorage, and no page script runs yet
    driver.execute_script("localStorage.clear(); if (arguments[0] !== null) localStorage.setItem('openk3.apiKey', "
                          "arguments[0]);", key)
    driver.get_log("browser"), driver.get_log("performance")
    driver.get(url + "/")
    if expect_model:
        wait(driver, lambda d: d.find_element(By.ID, "model-name").text == MODEL)
    return driver


def wait(driver, cond, timeout: float = 15):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(cond)


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def requested_urls(driver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def replies(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#log .msg.assistant")


def wait_reply_done(driver, n: int):
    """The n-th assistant reply (1-based) once its request ended (status shown, Send enabled again)."""
    wait(driver, lambda d: len(replies(d)) >= n and replies(d)[n - 1].find_element(By.CLASS_NAME, "status").text
         and d.find_element(By.ID, "send").is_enabled())
    return replies(driver)[n - 1]


# ---- the tests --------------------------------------------------------------------------------------------

def test_page_loads_with_no_errors_and_no_external_requests(server, browser):
    url, _, _ = server
    open_page(browser, url)
    assert browser.title == "openk3 chat"
    assert console_errors(browser) == []
    urls = requested_urls(browser)
    assert url + "/static/chat.js" in urls and url + "/v1/models" in urls
    assert [u for u in urls if not u.startswith(url + "/")] == []  # no CDN, no fonts, nothing elsewhere
    # every control is labelled (a screen reader names it), and Send / Stop start in their idle states
    unlabelled = browser.execute_script(
        "return [...document.querySelectorAll('input, select, textarea')].filter(e => !e.labels.length)"
        ".map(e => e.id)")
    assert unlabelled == []
    assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()


def test_streamed_reply_with_a_collapsible_dimmed_thinking_block(server, browser, tmp_path):
    url, _, _ = server
    open_page(browser, url)
    box = browser.find_element(By.ID, "input")
    box.send_keys("#script:text# hi", Keys.SHIFT, Keys.ENTER, Keys.NULL, "there")  # Shift+Enter: a new line
    assert box.get_attribute("value") == "#script:text# hi\nthere" and replies(browser) == []
    box.send_keys(Keys.ENTER)
    reply = wait_reply_done(browser, 1)
    assert browser.find_element(By.CSS_SELECTOR, "#log .msg.user .content").text == "#script:text# hi\nthere"
    assert reply.find_element(By.CLASS_NAME, "content").text == "Hello world. Bye"
    assert "stop" in reply.find_element(By.CLASS_NAME, "status").text
    thinking = reply.find_element(By.CSS_SELECTOR, "details.thinking")
    assert thinking.get_attribute("open") is None  # folded once the answer started
    assert float(thinking.value_of_css_property("opacity")) < 1  # dimmed
    thinking.find_element(By.TAG_NAME, "summary").click()
    assert thinking.get_attribute("open") is not None
    assert thinking.find_element(By.CLASS_NAME, "text").text == "hmm"
    shot = os.environ.get("OPENK3_WEB_SCREENSHOT") or str(tmp_path / "chat.png")  # set it to look at the page
    assert browser.save_screenshot(shot) and os.path.getsize(shot) > 0
    assert browser.find_element(By.ID, "input").get_attribute("value") == ""
    assert console_errors(browser) == []


def test_tool_call_is_a_structured_block(server, browser):
    url, _, _ = server
    open_page(browser, url)
    send(browser, "#script:tool# read notes.txt")
    reply = wait_reply_done(browser, 1)
    block = reply.find_element(By.CLASS_NAME, "tool-call")
    assert block.find_element(By.CLASS_NAME, "name").text == "ReadFile"
    assert block.find_element(By.CSS_SELECTOR, "pre.arguments").text == json.dumps({"path": "notes.txt"}, indent=2)
    assert block.get_attribute("aria-label") == "Tool call ReadFile"
    assert reply.find_element(By.CLASS_NAME, "content").text == "Let me check."
    assert "tool_calls" in reply.find_element(By.CLASS_NAME, "status").text


def test_effort_and_thinking_reach_the_server(server, browser):
    url, _, seen = server
    open_page(browser, url)
    Select(browser.find_element(By.ID, "effort")).select_by_value("low")
    send(browser, "#script:text# effort")
    wait_reply_done(browser, 1)
    assert seen["bodies"][-1]["reasoning_effort"] == "low" and "chat_template_kwargs" not in seen["bodies"][-1]
    assert b"thinking_effort=low" in seen["prompts"][-1]  # rendered into the prompt the engine ran
    browser.find_element(By.ID, "thinking").click()  # thinking off: no effort to pick
    assert not browser.find_element(By.ID, "effort").is_enabled()
    send(browser, "#script:text# no thinking")
    wait_reply_done(browser, 2)
    body = seen["bodies"][-1]
    assert body["chat_template_kwargs"] == {"thinking": False} and "reasoning_effort" not in body
    assert b"thinking_effort=" not in seen["prompts"][-1]
    # the choices are kept in localStorage: a reload keeps them
    browser.refresh()
    wait(browser, lambda d: d.find_element(By.ID, "model-name").text == MODEL)
    assert Select(browser.find_element(By.ID, "effort")).first_selected_option.text == "low"
    assert not browser.find_element(By.ID, "thinking").is_selected()
    browser.execute_script("localStorage.clear()")


def test_stop_aborts_the_stream_and_frees_the_slot(server, browser):
    url, state, _ = server
    open_page(browser, url)
    cancelled = state.metrics.cancelled
    send(browser, "#script:long# go on")  # "a" in the thinking channel until the 4096-token cap

    def thought(d) -> int:
        return len(d.execute_script("const t = document.querySelector('#log .thinking .text');"
                                    "return t ? t.textContent : ''"))

    wait(browser, lambda d: thought(d) > 0)
    first = thought(browser)
    wait(browser, lambda d: thought(d) > first)  # it grows while it streams
    assert state.loop.in_flight() == 1 and browser.find_element(By.ID, "stop").is_enabled()
    browser.find_element(By.ID, "stop").click()
    reply = wait_reply_done(browser, 1)
    wait_until(lambda: state.loop.in_flight() == 0 and state.metrics.running == 0, timeout=10)
    assert state.metrics.cancelled == cancelled + 1
    assert reply.find_element(By.CLASS_NAME, "status").text == "stopped"
    assert not browser.find_element(By.ID, "stop").is_enabled()
    assert len(reply.find_element(By.CSS_SELECTOR, ".thinking .text").get_attribute("textContent")) < 4000
    send(browser, "#script:long# again")  # Escape in the message box stops too
    wait(browser, lambda d: state.loop.in_flight() == 1)
    browser.find_element(By.ID, "input").send_keys(Keys.ESCAPE)
    assert wait_reply_done(browser, 2).find_element(By.CLASS_NAME, "status").text == "stopped"
    wait_until(lambda: state.loop.in_flight() == 0 and state.metrics.running == 0, timeout=10)
    assert state.metrics.cancelled == cancelled + 2
    assert console_errors(browser) == []


def test_second_turn_sends_the_first(server, browser):
    url, _, seen = server
    open_page(browser, url)
    send(browser, "#script:text# first")
    wait_reply_done(browser, 1)
    send(browser, "#script:text# second")
    second = wait_reply_done(browser, 2)
    assert second.find_element(By.CLASS_NAME, "content").text == "Hello world. Bye"
    assert seen["bodies"][-1]["messages"] == [
        {"role": "user", "content": "#script:text# first"},
        {"role": "assistant", "content": "Hello world. Bye", "reasoning_content": "hmm"},  # thinking goes back
        {"role": "user", "content": "#script:text# second"},
    ]
    assert b"#script:text# first" in seen["prompts"][-1] and b"Hello world. Bye" in seen["prompts"][-1]
    browser.find_element(By.ID, "new-chat").click()  # a new chat forgets them
    assert replies(browser) == []
    send(browser, "#script:text# third")
    wait_reply_done(browser, 1)
    assert seen["bodies"][-1]["messages"] == [{"role": "user", "content": "#script:text# third"}]


def test_wrong_api_key_shows_the_error(server, browser):
    url, _, seen = server
    open_page(browser, url)
    error = browser.find_element(By.ID, "error")
    browser.find_element(By.CSS_SELECTOR, "#settings summary").click()
    key = browser.find_element(By.ID, "api-key")

    def set_key(value: str) -> None:
        key.clear()
        key.send_keys(value, Keys.TAB)  # leaving the field is a change event: the page asks /v1/models again

    set_key("wrong")
    wait(browser, lambda d: error.is_displayed() and "wrong" in error.text)
    assert error.text == "Could not list the model: 401 authentication_error: wrong API key: send " \
                         "'Authorization: Bearer KEY'"
    sent = len(seen["bodies"])
    send(browser, "#script:text# hello")  # the chat request itself is refused
    wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled() and error.text.startswith("401"))
    assert error.text == "401 authentication_error: wrong API key: send 'Authorization: Bearer KEY'"
    assert len(seen["bodies"]) == sent and replies(browser) == []  # refused before the body was read
    # the failed turn is taken back: its text is in the box again, to send once the key is right
    assert browser.find_element(By.ID, "input").get_attribute("value") == "#script:text# hello"
    assert browser.find_elements(By.CSS_SELECTOR, "#log .msg") == []
    errors = console_errors(browser)
    assert errors and all("401" in m for m in errors)  # Chromium logs each refused request, nothing else
    set_key(KEY)
    wait(browser, lambda d: d.find_element(By.ID, "model-name").text == MODEL and not error.is_displayed())
    browser.find_element(By.ID, "input").send_keys(Keys.ENTER)
    assert wait_reply_done(browser, 1).find_element(By.CLASS_NAME, "content").text == "Hello world. Bye"
    assert seen["bodies"][-1]["messages"] == [{"role": "user", "content": "#script:text# hello"}]
    assert browser.execute_script("return localStorage.getItem('openk3.apiKey')") == KEY


def test_an_error_event_mid_stream_is_shown(browser):
    tok = byte_tokenizer()
    engine = script_engine(Engine(nano_model(), tok, max_num_seqs=1), tok)
    step, steps = engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 20:  # after some thinking has streamed
            raise RuntimeError("device lost")
        return step()

    engine.step = failing_step
    with served(create_app(engine, served_model_name=MODEL)) as url:
        open_page(browser, url, key=None)
        send(browser, "#script:long# go")
        reply = wait_reply_done(browser, 1)
        assert reply.find_element(By.CSS_SELECTOR, ".thinking .text").get_attribute("textContent").startswith("a")
        assert "device lost" in reply.find_element(By.CLASS_NAME, "status").text
        error = browser.find_element(By.ID, "error")
        assert error.is_displayed() and "device lost" in error.text


def test_missing_page_files_fail_at_startup(monkeypatch):
    # a wheel built without the package data: create_app says so instead of serving a broken page
    from openk3.serve import app as app_module

    monkeypatch.setitem(app_module._STATIC_TYPES, "gone.js", "text/javascript")
    tok = byte_tokenizer()
    with pytest.raises(RuntimeError, match=r"web page's files are missing .*gone\.js.*package-data"):
        create_app(Engine(nano_model(), tok, max_num_seqs=1), served_model_name=MODEL)
