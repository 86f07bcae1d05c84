/work/main/bench/noop-native/target/release/libnoop.so: /work/main/bench/noop-native/src/lib.rs
