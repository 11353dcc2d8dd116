"""What the source route takes from Debian: a package installed with
apt-get (libnuma-dev) and oneDNN's source tarball, fetched with a private
sources list so that the system's apt configuration stays untouched."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from . import common
from .common import InstallError, log, run

ONEDNN_DEB_VERSION = "3.7.2+ds-2"


def ensure_package(name: str) -> None:
    """Installs Debian package `name` unless it is installed."""
    probe = subprocess.run(["dpkg", "-s", name], capture_output=True)
    if probe.returncode == 0:
        return
    _need_root(f"installing {name}")
    log(f"installing {name}")
    run(["apt-get", "-q", "update"])
    run(
        ["apt-get", "install", "-y", "-q", name],
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise InstallError(f"{what} needs root (apt-get); do it by hand first")


def onednn_sources() -> Path:
    """Debian trixie's oneDNN source tarball, in the cache.

    A private sources list keeps the system's apt configuration untouched.
    """
    downloads = common.CACHE / "downloads"
    cached = sorted(downloads.glob("onednn_*.orig.tar.*"))
    if cached:
        return cached[-1]
    _need_root("downloading oneDNN's Debian source package")
    apt = common.CACHE / "apt"
    shutil.rmtree(apt, ignore_errors=True)
    for d in ("lists/partial", "cache/archives/partial", "src"):
        (apt / d).mkdir(parents=True)
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    (apt / "sources.list").write_text(
        f"deb-src [signed-by={keyring}] {_debian_mirror()} trixie main\n"
    )
    opts = [
        "-o",
        f"Dir::Etc::sourcelist={apt / 'sources.list'}",
        "-o",
        "Dir::Etc::sourceparts=-",
        "-o",
        f"Dir::State::Lists={apt / 'lists'}",
        "-o",
        f"Dir::Cache={apt / 'cache'}",
        "-o",
        "APT::Sandbox::User=root",
    ]
    log(f"fetching oneDNN {ONEDNN_DEB_VERSION} sources (Debian trixie)")
    run(["apt-get", *opts, "-q", "update"])
    source = ["apt-get", *opts, "-q", "source", "--download-only"]
    if subprocess.run(
        [*source, f"onednn={ONEDNN_DEB_VERSION}"], cwd=apt / "src"
    ).returncode:
        log(f"onednn={ONEDNN_DEB_VERSION} is gone; taking trixie's current one")
        run([*source, "onednn"], cwd=apt / "src")
    (orig,) = (apt / "src").glob("onednn_*.orig.tar.*")
    dest = downloads / orig.name
    shutil.move(orig, dest)
    shutil.rmtree(apt)
    return dest


def _debian_mirror() -> str:
    for sources in Path("/etc/apt/sources.list.d").glob("*.sources"):
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "/debian" in line:
                return line.split()[1].rstrip("/")
    return "http://deb.debian.org/debian"
