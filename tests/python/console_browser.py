"""Drives hcp-sense's operator console in Debian's headless Chromium with Selenium.

Reads a plan as JSON on standard input:
  {"url": "http://127.0.0.1:PORT", "admin": TOKEN, "runtime": TOKEN, "reader": TOKEN,
   "screenshots": DIR or ""}
The server has the `github` pack registered and a Binding for alice; alice is neither granted
nor activated. As the admin the script signs in, grants and activates alice on the Principal
page, watches her inbox, delivers a trigger through the JSON API (as the runtime) and waits for
it on the page; delivers an undeclared ref and finds its drop reason and its decision; explains
a trigger; sets a quota. Then it signs in as the reader and tries to grant. With a screenshots
directory, each page is saved there as PNG. Prints one JSON report of what it saw.
"""
import json
import os
import sys
import tempfile
import time
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

XSS = "<img src=x onerror=alert(1)>"


def browser():
    o = webdriver.ChromeOptions()
    o.binary_location = "/usr/bin/chromium"
    for flag in [
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--window-size=1280,1000",
        "--user-data-dir=" + tempfile.mkdtemp(prefix="hcp-console-"),
    ]:
        o.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=o)


def get(base, path, token):
    req = urllib.request.Request(base + path)
    req.add_header("Authorization", "Bearer " + token)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def post(base, path, token, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", "Bearer " + token)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


class Console:
    def __init__(self, driver, base, shots):
        self.d = driver
        self.base = base
        self.shots = shots

    def wait(self, what, seconds=15):
        return WebDriverWait(self.d, seconds, poll_frequency=0.1).until(lambda d: what())

    def text(self, css):
        return self.d.find_element(By.CSS_SELECTOR, css).text

    def type(self, id_, value):
        e = self.d.find_element(By.ID, id_)
        e.clear()
        e.send_keys(value)

    def click(self, css):
        self.d.find_element(By.CSS_SELECTOR, css).click()

    def page(self, name):
        self.d.get(self.base + "/console/#" + name)
        self.wait(lambda: self.d.find_element(By.ID, name).is_displayed())

    def shot(self, name):
        if self.shots:
            self.d.execute_script("window.scrollTo(0, 0)")
            self.d.save_screenshot(os.path.join(self.shots, name + ".png"))

    def sign_in(self, token):
        self.page("signin")
        self.type("token", token)
        # By keyboard: Enter in the field submits the form.
        self.d.find_element(By.ID, "token").send_keys(Keys.ENTER)
        self.wait(lambda: self.text("#who").startswith("Signed in as"))
        return self.text("#who")

    def message(self):
        return self.text("#message")


def main():
    plan = json.load(sys.stdin)
    base = plan["url"]
    shots = plan.get("screenshots") or ""
    if shots:
        os.makedirs(shots, exist_ok=True)
    report = {"ok": False}
    d = browser()
    try:
        c = Console(d, base, shots)
        report["who"] = c.sign_in(plan["admin"])
        c.shot("signin")

        c.page("packs")
        c.click("#packs-load")
        c.wait(lambda: "github" in c.text("#packs-table tbody"))
        c.click("#packs-table tbody button")
        c.wait(lambda: "issue.opened" in c.text("#catalog"))
        for summary in d.find_elements(By.CSS_SELECTOR, "#catalog summary"):
            summary.click()
        report["description_as_text"] = (
            "<img src=x onerror=alert(2)><script>alert(3)</script>" in c.text("#catalog")
            and not d.find_elements(By.CSS_SELECTOR, "#catalog img, #catalog script"))
        c.shot("packs")

        c.page("principal")
        c.type("grant-principal", "alice")
        c.type("grant-pack", "github")
        c.click("#grant-form button[value=grant]")
        c.wait(lambda: c.message().startswith("Granted"))
        c.type("act-principal", "alice")
        c.type("act-pack", "github")
        c.click("#activate-form button[value=activate]")
        c.wait(lambda: c.message().startswith("Activated"))
        # The console's changes are the audited API's: who made them is the signed-in caller.
        events = get(base, "/v1/auditEvents?pack_id=github&principal=alice", plan["admin"]).get("auditEvents", [])
        report["audited"] = sorted({(e.get("actor"), e.get("rpc")) for e in events if e.get("rpc") in ("GrantSenseEnable", "ActivateSense")})
        c.type("principal-id", "alice")
        c.click("#principal-form button[type=submit]")
        c.wait(lambda: "github" in c.text("#principal-view") and "issue.opened" in c.text("#principal-view"))
        cells = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#state-table tbody tr:first-child td")]
        report["state_row"] = cells
        report["granted"] = len(cells) > 2 and cells[1] == "yes" and cells[2] == "yes"
        c.shot("principal")

        # A record before the watch: listed among the recent ones.
        post(base, "/v1/triggers:deliver", plan["runtime"], {
            "packId": "github", "ref": "issue.opened", "principal": "alice", "land": "user",
            "triggerId": "console-0", "payload": {"action": "opened", "issue": {"number": 0, "title": "earlier"}},
        })
        c.page("inbox")
        c.type("inbox-principal", "alice")
        c.click("#inbox-form button[type=submit]")
        c.wait(lambda: c.text("#inbox-state").startswith("Watching"))
        time.sleep(0.5)
        post(base, "/v1/triggers:deliver", plan["runtime"], {
            "packId": "github", "ref": "issue.opened", "principal": "alice", "land": "user",
            "triggerId": "console-1", "payload": {"action": "opened", "issue": {"number": 1, "title": XSS}},
        })
        c.wait(lambda: len(d.find_elements(By.CSS_SELECTOR, "#inbox-table tbody tr.record")) > 1)
        rows = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#inbox-table tbody tr.record")]
        report["inbox_rows"] = len(rows)
        report["recent_listed"] = "earlier" in rows[-1]
        row = rows[0]
        report["inbox_row"] = "issue.opened" in row and "alice" in row
        report["payload_as_text"] = XSS in row
        report["injected_elements"] = len(d.find_elements(By.CSS_SELECTOR, "main img"))
        c.shot("inbox")
        c.click("#inbox-stop")

        post(base, "/v1/triggers:deliver", plan["runtime"], {
            "packId": "github", "ref": "issue.nope", "principal": "alice", "land": "user",
            "triggerId": "console-drop", "payload": {},
        })
        c.page("drops")
        c.click("#drops-form button[type=submit]")
        c.wait(lambda: "undeclared_ref" in c.text("#drops-table tbody"))
        report["drop_reason_shown"] = True
        c.wait(lambda: "undeclared_ref" in c.text("#drops-time-table thead"))
        report["drops_over_time"] = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#drops-time-table tbody td")]
        c.type("dec-pack", "github")
        c.type("dec-trigger", "console-drop")
        c.click("#decisions-form button[type=submit]")
        c.wait(lambda: "console-drop" in c.text("#decisions-table tbody"))
        cells = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#decisions-table tbody tr:first-child td")]
        report["decision_row"] = cells
        report["deciding_check_shown"] = len(cells) > 7 and cells[5] == "dropped" and cells[7] != ""
        c.shot("drops")

        c.page("explain")
        c.type("ex-pack", "github")
        c.type("ex-ref", "issue.opened")
        c.type("ex-principal", "alice")
        c.click("#explain-form button[type=submit]")
        c.wait(lambda: "Would be" in c.text("#explain-result"))
        report["explained"] = c.text("#explain-result h3")
        c.shot("explain")

        c.page("quotas")
        c.type("q-pack", "github")
        c.type("q-rate", "10")
        c.type("q-burst", "20")
        c.click("#quota-form button[value=put]")
        c.wait(lambda: "github" in c.text("#quotas-table tbody"))
        c.click("#quotas-table tbody button")
        c.wait(lambda: "admits now" in c.text("#quotas-table tbody") or "refuses now" in c.text("#quotas-table tbody"))
        report["admission"] = c.text("#quotas-table tbody tr")
        c.shot("quotas")

        c.page("signin")
        c.click("#signout")
        report["reader_who"] = c.sign_in(plan["reader"])
        c.page("principal")
        c.type("grant-principal", "alice")
        c.type("grant-pack", "github")
        c.click("#grant-form button[value=grant]")
        c.wait(lambda: "403" in c.message())
        report["reader_grant"] = c.message()
        c.shot("reader-refused")
        # Every form control has a label; every table a caption; the page a language.
        report["unlabelled"] = d.execute_script(
            "return [...document.querySelectorAll('input, select, textarea')]"
            ".filter(e => !document.querySelector('label[for=\"' + e.id + '\"]')).map(e => e.id || e.name);")
        report["tables_without_caption"] = d.execute_script(
            "return [...document.querySelectorAll('table')].filter(t => !t.querySelector('caption')).length;")
        report["lang"] = d.execute_script("return document.documentElement.lang;")
        try:
            d.switch_to.alert
            report["alerts"] = 1
        except NoAlertPresentException:
            report["alerts"] = 0
        report["ok"] = True
    except TimeoutException as e:
        report["failed"] = "timed out: " + str(e)
        report["page"] = d.find_element(By.TAG_NAME, "main").text[:3000]
        report["logs"] = [str(x) for x in d.get_log("browser")][:20] if hasattr(d, "get_log") else []
    finally:
        d.quit()
    print(json.dumps(report))


main()
