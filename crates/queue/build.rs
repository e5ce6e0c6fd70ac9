// The migrations are embedded by `sqlx::migrate!`: rebuild when one is added or changed (without
// this a new migration file left an incremental build with the queue's previous schema).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
