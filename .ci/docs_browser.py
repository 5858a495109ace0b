"""Opens the built site in a real headless browser and checks what it shows.

    python .ci/docs_browser.py docs/_build/html [SCREENSHOT_DIR]

Chromium (Debian's `chromium` package, `$KMP_CHROMIUM` or /usr/bin/chromium)
driven by Playwright opens the landing page, a guide, an API page and the
performance page from the files, and checks on each that the page rendered:
its title, its stylesheet applied, its code blocks laid out with a height,
every image loaded and the tables there (the performance page's plots and
tables), and no script error. A
full-page screenshot of each goes to SCREENSHOT_DIR (default:
`$KMP_DOCS_SCREENSHOTS`, else `.ci/logs/docs`). Exits 1 naming every check
that failed.
"""

import os
import pathlib
import sys

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# page file -> (screenshot name, heading, least code blocks, images, tables)
GUIDE = "Mixed precision with kmp"
PAGES = {
    "index.html": ("landing", "kmp: mixed precision for Keras 3", 2, 0, 0),
    "guides/mixed_precision.html": ("guide", GUIDE, 10, 0, 0),
    "api/kmp.html": ("api", "kmp", 3, 0, 0),
    "performance.html": ("performance", "Performance", 0, 10, 10),
}

# What the page shows, measured in the browser.
MEASURE = """() => {
  const visible = (e) => e.getBoundingClientRect().height > 0;
  const code = [...document.querySelectorAll('div.highlight pre')];
  const images = [...document.querySelectorAll('article img')];
  const h1 = document.querySelector('article h1');
  return {
    heading: h1 ? h1.textContent.replace(/[#¶]/g, '').trim() : null,
    code: code.filter(visible).length,
    codeText: code.map((e) => e.textContent).join('\\n').length,
    images: images.length,
    tables: document.querySelectorAll('article table').length,
    brokenImages: images.filter((e) => !(e.complete && e.naturalWidth > 0))
      .map((e) => e.getAttribute('src')),
    // Furo's stylesheet sets the body's font; the browser's default is serif.
    font: getComputedStyle(document.body).fontFamily,
    outputs: document.querySelectorAll('div.cell_output').length,
  };
}"""


def check_page(page, site: pathlib.Path, name: str, shots: pathlib.Path):
    """Opens one page; returns the list of failed checks."""
    shot, heading, least_code, least_images, least_tables = PAGES[name]
    errors = []
    page.on("pageerror", lambda error: errors.append(f"script error: {error}"))
    response = page.goto((site / name).as_uri(), wait_until="load")
    if response is not None and not response.ok:
        errors.append(f"status {response.status}")
    found = page.evaluate(MEASURE)
    page.screenshot(path=str(shots / f"{shot}.png"), full_page=True)
    if found["heading"] != heading:
        errors.append(f"heading {found['heading']!r}, expected {heading!r}")
    if found["code"] < least_code or (least_code and not found["codeText"]):
        errors.append(
            f"{found['code']} code blocks rendered, expected {least_code}+"
        )
    if found["images"] < least_images:
        errors.append(f"{found['images']} images, expected {least_images}+")
    if found["tables"] < least_tables:
        errors.append(f"{found['tables']} tables, expected {least_tables}+")
    if found["brokenImages"]:
        errors.append(f"images not loaded: {found['brokenImages']}")
    if "serif" == found["font"].strip().lower() or not found["font"]:
        errors.append(f"stylesheet not applied (font {found['font']!r})")
    print(
        f"{name}: heading {found['heading']!r}, {found['code']} code blocks, "
        f"{found['outputs']} cell outputs, {found['images']} images, "
        f"{found['tables']} tables; "
        f"screenshot {shots / (shot + '.png')}"
    )
    return [f"{name}: {error}" for error in errors]


def main(argv) -> int:
    from playwright.sync_api import sync_playwright

    site = pathlib.Path(argv[0]).resolve()
    default = os.environ.get("KMP_DOCS_SCREENSHOTS", ".ci/logs/docs")
    shots = pathlib.Path(argv[1] if len(argv) > 1 else default)
    shots.mkdir(parents=True, exist_ok=True)
    chromium = os.environ.get("KMP_CHROMIUM", "/usr/bin/chromium")
    failures = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium, args=ARGS, headless=True
        )
        print("browser:", browser.version)
        for name in PAGES:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            failures += check_page(page, site, name, shots)
            page.close()
        browser.close()
    for failure in failures:
        print("FAILED:", failure)
    failed = {failure.split(":")[0] for failure in failures}
    print(f"browser check: {len(PAGES) - len(failed)} of {len(PAGES)} pages")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["docs/_build/html"]))
