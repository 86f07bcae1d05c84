//! The dynamic module binds every Envoy callback when it is loaded (`-z now`): an Envoy without
//! one of them refuses to load it, naming the symbol, instead of failing at the first call.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,now");
}
