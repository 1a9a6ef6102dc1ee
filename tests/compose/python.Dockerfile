# The stand-in for python:3.11-slim (no registry here): Debian bookworm's Python 3.11 from a
# debootstrap root (imported as ROOTFS by tests/compose/run.py), with `python` and `pip` on PATH
# as the official image has them (a venv at /usr/local/python, so pip may install as root).
#
# The build context is assembled by run.py, never committed: this machine's pip configuration
# and CA bundle (builds reach the package registry as this machine does) and the CPU torch wheel
# its pip takes from local disk (PyPI's default torch is a multi-GB CUDA build).
ARG ROOTFS=hsx-compose-test/rootfs:bookworm
FROM ${ROOTFS}

ENV PATH=/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8
COPY ca-bundle.crt /etc/ssl/certs/hsx-build-ca.crt
COPY pip.conf /etc/pip.conf
COPY wheels/ /opt/wheels/
RUN python3 -m venv /usr/local/python \
 && python --version && pip --version
CMD ["python3"]
