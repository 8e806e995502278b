#!/usr/bin/env python3
"""Drives a running `sieve serve` with clients nobody on this project wrote.

- the official `openai` Python package: a completion, a streamed chat completion, an error case;
- headless Chromium (through Selenium and chromedriver): opens the chat page at /, sends a
  message and waits for streamed text to appear, then saves a screenshot.

Usage: serve_clients_test.py BASE_URL API_KEY [--screenshot PATH] [--skip-browser REASON]
Prints one line per check and a closing 'N passed, N failed' line; exits non-zero on a failure.
"""

import argparse
import sys
import time
import traceback

RESULTS = []


def check(name):
    def wrap(fn):
        def run(*args):
            started = time.time()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - report every failure and go on
                RESULTS.append(False)
                print(f"FAIL {name} ({time.time() - started:.1f} s)")
                traceback.print_exc()
            else:
                RESULTS.append(True)
                print(f"ok   {name} ({time.time() - started:.1f} s)")
        return run
    return wrap


def openai_checks(base, key):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)
    model = None

    @check("openai: models.list names the served model")
    def models():
        nonlocal model
        ids = [m.id for m in client.models.list().data]
        assert len(ids) == 1, ids
        model = ids[0]

    @check("openai: completions.create (greedy, usage counted)")
    def completion():
        r = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert r.object == "text_completion", r
        text = r.choices[0].text
        assert text.strip(), r
        assert r.choices[0].finish_reason in ("stop", "length"), r
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens >= 1, r.usage
        # Greedy is deterministic: the same request gives the same text.
        again = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert again.choices[0].text == text, (again.choices[0].text, text)

    @check("openai: chat.completions.create(stream=True) streams deltas")
    def streamed_chat():
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Name three colors."}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.finish_reason:
                    finish = choice.finish_reason
        assert len(pieces) >= 2, pieces
        assert "".join(pieces).strip(), pieces
        assert finish in ("stop", "length"), finish
        assert usage is not None and usage.completion_tokens >= len(pieces) - 1, usage
        whole = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Name three colors."}],
            max_tokens=16,
            temperature=0,
        )
        assert whole.choices[0].message.content == "".join(pieces), (whole, pieces)

    @check("openai: errors arrive as the package's typed exceptions")
    def errors():
        try:
            client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        except openai.NotFoundError as e:
            assert "no-such-model" in str(e), e
        else:
            raise AssertionError("an unknown model was served")
        try:
            client.completions.create(model=model, prompt="x", max_tokens=10**9)
        except openai.BadRequestError as e:
            assert e.body and e.body.get("param") == "max_tokens", e.body
        else:
            raise AssertionError("max_tokens over the cap was served")
        bad_key = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        try:
            bad_key.models.list()
        except openai.AuthenticationError:
            pass
        else:
            raise AssertionError("a wrong API key was accepted")

    models()
    completion()
    streamed_chat()
    errors()


def browser_check(base, key, screenshot):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    @check("chromium: the chat page streams a reply and shows tokens/s")
    def page():
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,760",
                     "--disable-dev-shm-usage", "--no-proxy-server"):
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
        try:
            driver.set_page_load_timeout(60)
            driver.get(base + "/")
            # The page keeps the key in localStorage; reloaded, it lists the model with it.
            driver.execute_script("localStorage.setItem('sieve-api-key', arguments[0])", key)
            driver.refresh()
            wait = WebDriverWait(driver, 120, poll_frequency=0.05)
            wait.until(lambda d: "SmolLM2" in d.find_element(By.ID, "model").text)
            driver.find_element(By.ID, "max-tokens").clear()
            driver.find_element(By.ID, "max-tokens").send_keys("48")
            driver.find_element(By.ID, "prompt").send_keys("Write one sentence about the sea.")
            driver.find_element(By.ID, "send").click()
            # Streamed: text is on the page while the reply is still coming in.
            wait.until(lambda d: d.execute_script(
                "const m = document.querySelector('.assistant');"
                "return m && m.dataset.state === 'streaming' && m.textContent.length > 0;"))
            wait.until(lambda d: d.execute_script(
                "const m = document.querySelector('.assistant');"
                "return m && m.dataset.state !== 'streaming';"))
            state = driver.execute_script("return document.querySelector('.assistant').dataset.state")
            reply = driver.find_element(By.CSS_SELECTOR, ".assistant").text
            stats = driver.find_element(By.ID, "stats").text
            errors = driver.find_elements(By.CSS_SELECTOR, ".error")
            assert state == "done", (state, [e.text for e in errors])
            assert reply.strip(), reply
            assert "tok/s" in stats and "tokens" in stats, stats
            if screenshot:
                driver.save_screenshot(screenshot)
                print(f"     screenshot: {screenshot}")
            print(f"     reply: {reply[:80]!r}; {stats}")
        finally:
            driver.quit()

    page()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("key")
    parser.add_argument("--screenshot")
    parser.add_argument("--skip-browser", metavar="REASON")
    args = parser.parse_args()
    openai_checks(args.base, args.key)
    if args.skip_browser:
        print(f"SKIPPED chromium page test: {args.skip_browser}")
    else:
        browser_check(args.base, args.key, args.screenshot)
    passed, failed = RESULTS.count(True), RESULTS.count(False)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
