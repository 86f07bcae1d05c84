# The quota service image: built in a Rust image, run from a small distroless one.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# Every workspace member's manifest and sources: cargo reads the whole workspace to build one.
COPY Cargo.toml Cargo.lock ./
COPY core core
COPY native native
COPY quota quota
COPY src src
COPY cli cli
COPY testbed testbed
COPY testkit testkit
COPY fleet fleet
RUN cargo build --release --locked -p tollgate-quota

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/tollgate-quota /usr/local/bin/tollgate-quota
EXPOSE 8090
ENTRYPOINT ["/usr/local/bin/tollgate-quota"]
CMD ["--listen", "0.0.0.0:8090"]
