//! The Redis/Valkey server the index tests run against: found without root (PATH, or the Valkey
//! wheel `make test` installs into the venv), started on a random port, answering, killed on drop.
//! Fails, never skips, when no server can be found or started.

use crate::common;

use common::deploy::{find_redis_server, redis_command, RedisProc};

fn server() -> RedisProc {
    let bin = find_redis_server().unwrap_or_else(|e| panic!("{e:#}"));
    RedisProc::start(&bin).unwrap_or_else(|e| panic!("{}: {e:#}", bin.display()))
}

#[test]
fn a_server_starts_on_a_random_port_and_answers() {
    let r = server();
    assert_eq!(redis_command(r.addr, &["SET", "k", "v"]).unwrap(), "+OK");
    assert_eq!(redis_command(r.addr, &["EXISTS", "k"]).unwrap(), ":1");
    // Fault tests slow the server with DEBUG SLEEP: the command must be enabled.
    assert_eq!(
        redis_command(r.addr, &["DEBUG", "SLEEP", "0"]).unwrap(),
        "+OK"
    );
    assert!(r.url().starts_with("redis://127.0.0.1:"));
}

#[test]
fn two_servers_get_distinct_ports_and_a_killed_one_stops_answering() {
    let a = server();
    let mut b = server();
    assert_ne!(a.addr, b.addr);
    let addr = b.addr;
    b.kill();
    assert!(
        redis_command(addr, &["PING"]).is_err(),
        "a killed server must not answer"
    );
    assert_eq!(redis_command(a.addr, &["PING"]).unwrap(), "+PONG");
}
