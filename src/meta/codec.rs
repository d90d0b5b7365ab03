//! The binary form of state-machine commands: one batch of [`Command`]s is the data of one Raft
//! entry.
//!
//! # Wire format of commands
//! [`encode_batch`] / [`decode_batch`] give the compact binary form stored in one Raft entry
//! (see `record.rs` for the record around it): a format byte, a varint count, then per command
//! a tag byte and its fields (varint integers, varint-length-prefixed UTF-8 strings, bools as one
//! byte, field tables in their AMQP 0-9-1 wire form, spec section 4.2.5.5). The same field-table
//! form is used by serde, so a table holding a NaN double or a byte array survives a snapshot
//! exactly.

use super::grow::CopiedMessage;
use super::state::Command;
use super::topology::{Binding, DestKind, ExchangeDef, ExchangeKind, QueueDef};
use super::wire::{put_blob, put_str, put_table, put_varint, DecodeError, Reader};

/// Format byte at the start of every encoded batch.
const BATCH_FORMAT_V1: u8 = 1;

/// Appends the binary form of `cmds` (one batch, one Raft entry's data) to `out`; `count` must
/// be the number of commands `cmds` yields.
pub fn encode_batch<'a>(count: usize, cmds: impl IntoIterator<Item = &'a Command>, out: &mut Vec<u8>) {
    out.push(BATCH_FORMAT_V1);
    put_varint(out, count as u64);
    let mut n = 0;
    for cmd in cmds {
        encode_command(cmd, out);
        n += 1;
    }
    debug_assert_eq!(n, count, "encode_batch: count does not match the commands");
}

/// Decodes a batch written by [`encode_batch`].
pub fn decode_batch(data: &[u8]) -> Result<Vec<Command>, DecodeError> {
    let mut r = Reader { buf: data, pos: 0 };
    if r.u8()? != BATCH_FORMAT_V1 {
        return Err(r.err("unknown batch format"));
    }
    let n = r.varint()?;
    if n > data.len() as u64 {
        return Err(r.err("command count larger than the entry"));
    }
    let mut cmds = Vec::with_capacity(n as usize);
    for _ in 0..n {
        cmds.push(decode_command(&mut r)?);
    }
    if r.pos != data.len() {
        return Err(r.err("trailing bytes after the batch"));
    }
    Ok(cmds)
}

const TAG_DECLARE_VHOST: u8 = 1;
const TAG_DECLARE_EXCHANGE: u8 = 2;
const TAG_DELETE_EXCHANGE: u8 = 3;
const TAG_DECLARE_QUEUE: u8 = 4;
const TAG_DELETE_QUEUE: u8 = 5;
const TAG_BIND: u8 = 6;
const TAG_UNBIND: u8 = 7;
const TAG_CURSOR_CAS: u8 = 8;
const TAG_NODE_BOOT: u8 = 9;
/// `NodeBoot` of one node of a cluster, with the epoch it boots from (tag 9 is a single
/// node's, as in logs from before clusters).
const TAG_NODE_BOOT_CLUSTER: u8 = 10;
const TAG_ENQUEUE: u8 = 11;
const TAG_SETTLE: u8 = 12;
const TAG_MOVE_QUEUE: u8 = 13;
const TAG_LEAVE_REPLICA_SET: u8 = 14;
const TAG_RESERVE: u8 = 15;
const TAG_GROW_REPLICA_SET: u8 = 16;
const TAG_COPY_MESSAGES: u8 = 17;
const TAG_JOIN_REPLICA_SET: u8 = 18;
const TAG_RETURN: u8 = 19;
const TAG_SET_CLUSTER_NAME: u8 = 20;
const TAG_LOG_COMPACTED: u8 = 21;

fn encode_command(cmd: &Command, out: &mut Vec<u8>) {
    if super::access::encode(cmd, out) {
        return;
    }
    match cmd {
        Command::DeclareVhost { name } => {
            out.push(TAG_DECLARE_VHOST);
            put_str(out, name);
        }
        Command::DeclareExchange(def) => {
            out.push(TAG_DECLARE_EXCHANGE);
            put_str(out, &def.vhost);
            put_str(out, &def.name);
            out.push(match def.kind {
                ExchangeKind::Direct => 0,
                ExchangeKind::Fanout => 1,
                ExchangeKind::Topic => 2,
                ExchangeKind::Headers => 3,
            });
            out.push(def.durable as u8 | (def.auto_delete as u8) << 1 | (def.internal as u8) << 2);
            put_table(out, &def.arguments);
        }
        Command::DeleteExchange { vhost, name, if_unused } => {
            out.push(TAG_DELETE_EXCHANGE);
            put_str(out, vhost);
            put_str(out, name);
            out.push(*if_unused as u8);
        }
        Command::DeclareQueue(def) => {
            out.push(TAG_DECLARE_QUEUE);
            put_str(out, &def.vhost);
            put_str(out, &def.name);
            let replicas = !def.replicas.is_empty();
            let incarnation = def.incarnation != 0;
            out.push(
                def.durable as u8
                    | (def.auto_delete as u8) << 1
                    | (def.exclusive_owner.is_some() as u8) << 2
                    | (replicas as u8) << 3
                    | (incarnation as u8) << 4,
            );
            if let Some(owner) = def.exclusive_owner {
                put_varint(out, owner);
            }
            put_table(out, &def.arguments);
            put_varint(out, def.owner_node);
            put_varint(out, u64::from(def.owner_core));
            put_varint(out, def.owner_epoch);
            // Bit 3 of the flags: a replica set follows (logs from before replica sets lack it).
            if replicas {
                put_varint(out, def.replicas.len() as u64);
                for id in &def.replicas {
                    put_varint(out, *id);
                }
            }
            // Bit 4: the incarnation follows.
            if incarnation {
                put_varint(out, def.incarnation);
            }
        }
        Command::DeleteQueue { vhost, name } => {
            out.push(TAG_DELETE_QUEUE);
            put_str(out, vhost);
            put_str(out, name);
        }
        Command::Bind(b) | Command::Unbind(b) => {
            out.push(if matches!(cmd, Command::Bind(_)) { TAG_BIND } else { TAG_UNBIND });
            put_str(out, &b.vhost);
            put_str(out, &b.source);
            out.push(match b.dest_kind {
                DestKind::Queue => 0,
                DestKind::Exchange => 1,
            });
            put_str(out, &b.dest);
            put_str(out, &b.routing_key);
            put_table(out, &b.arguments);
        }
        Command::CursorCas { vhost, queue, expected, new } => {
            out.push(TAG_CURSOR_CAS);
            put_str(out, vhost);
            put_str(out, queue);
            put_varint(out, *expected);
            put_varint(out, *new);
        }
        Command::NodeBoot { node, cluster } => {
            out.push(if cluster.is_some() { TAG_NODE_BOOT_CLUSTER } else { TAG_NODE_BOOT });
            put_varint(out, *node);
            if let Some(prev) = cluster {
                put_varint(out, *prev);
            }
        }
        Command::Enqueue { vhost, queue, flags, header, body } => {
            out.push(TAG_ENQUEUE);
            put_str(out, vhost);
            put_str(out, queue);
            out.push(*flags);
            put_blob(out, header);
            put_blob(out, body);
        }
        Command::Settle { vhost, queue, offsets } => {
            out.push(TAG_SETTLE);
            put_str(out, vhost);
            put_str(out, queue);
            put_varint(out, offsets.len() as u64);
            for o in offsets {
                put_varint(out, *o);
            }
        }
        Command::Return { vhost, queue, counts } => {
            out.push(TAG_RETURN);
            put_str(out, vhost);
            put_str(out, queue);
            put_varint(out, counts.len() as u64);
            for (o, n) in counts {
                put_varint(out, *o);
                put_varint(out, u64::from(*n));
            }
        }
        Command::MoveQueue { vhost, queue, from, to, to_epoch } => {
            out.push(TAG_MOVE_QUEUE);
            put_str(out, vhost);
            put_str(out, queue);
            put_varint(out, *from);
            put_varint(out, *to);
            put_varint(out, *to_epoch);
        }
        Command::LeaveReplicaSet { vhost, queue, node } => {
            out.push(TAG_LEAVE_REPLICA_SET);
            put_str(out, vhost);
            put_str(out, queue);
            put_varint(out, *node);
        }
        Command::Reserve { vhost, queue, node, until } => {
            out.push(TAG_RESERVE);
            put_str(out, vhost);
            put_str(out, queue);
            put_varint(out, *node);
            put_varint(out, *until);
        }
        Command::GrowReplicaSet { vhost, queue, node, id } => {
            out.push(TAG_GROW_REPLICA_SET);
            put_str(out, vhost);
            put_str(out, queue);
            put_varint(out, *node);
            put_varint(out, *id);
        }
        Command::CopyMessages { vhost, queue, id, from, to, messages } => {
            out.push(TAG_COPY_MESSAGES);
            put_str(out, vhost);
            put_str(out, queue);
            put_varint(out, *id);
            put_varint(out, *from);
            put_varint(out, *to);
            put_varint(out, messages.len() as u64);
            for m in messages {
                put_varint(out, m.offset);
                out.push(m.flags);
                put_blob(out, &m.header);
                put_blob(out, &m.body);
            }
        }
        // Tags 32 and up: `access.rs` wrote them above.
        Command::DeleteVhost { .. }
        | Command::PutUser(_)
        | Command::DeleteUser { .. }
        | Command::SetPermission(_)
        | Command::ClearPermission { .. }
        | Command::SetPolicy(_)
        | Command::ClearPolicy { .. } => unreachable!("encoded by access::encode"),
        Command::JoinReplicaSet { vhost, queue, id, tail } => {
            out.push(TAG_JOIN_REPLICA_SET);
            put_str(out, vhost);
            put_str(out, queue);
            put_varint(out, *id);
            put_varint(out, *tail);
        }
        Command::SetClusterName { name, permanent_id, initial } => {
            out.push(TAG_SET_CLUSTER_NAME);
            put_str(out, name);
            put_str(out, permanent_id);
            out.push(*initial as u8);
        }
        Command::LogCompacted { index } => {
            out.push(TAG_LOG_COMPACTED);
            put_varint(out, *index);
        }
    }
}

fn decode_command(r: &mut Reader<'_>) -> Result<Command, DecodeError> {
    let tag = r.u8()?;
    Ok(match tag {
        TAG_DECLARE_VHOST => Command::DeclareVhost { name: r.string()? },
        TAG_DECLARE_EXCHANGE => {
            let vhost = r.string()?;
            let name = r.string()?;
            let kind = match r.u8()? {
                0 => ExchangeKind::Direct,
                1 => ExchangeKind::Fanout,
                2 => ExchangeKind::Topic,
                3 => ExchangeKind::Headers,
                _ => return Err(r.err("unknown exchange kind")),
            };
            let flags = r.u8()?;
            Command::DeclareExchange(ExchangeDef {
                vhost,
                name,
                kind,
                durable: flags & 1 != 0,
                auto_delete: flags & 2 != 0,
                internal: flags & 4 != 0,
                arguments: r.table()?,
            })
        }
        TAG_DELETE_EXCHANGE => Command::DeleteExchange { vhost: r.string()?, name: r.string()?, if_unused: r.u8()? != 0 },
        TAG_DECLARE_QUEUE => {
            let vhost = r.string()?;
            let name = r.string()?;
            let flags = r.u8()?;
            let exclusive_owner = if flags & 4 != 0 { Some(r.varint()?) } else { None };
            let arguments = r.table()?;
            let owner_node = r.varint()?;
            let owner_core = u32::try_from(r.varint()?).map_err(|_| r.err("owner core out of range"))?;
            let owner_epoch = r.varint()?;
            let mut replicas = Vec::new();
            if flags & 8 != 0 {
                let n = r.varint()?;
                if n > r.buf.len() as u64 {
                    return Err(r.err("replica count larger than the entry"));
                }
                for _ in 0..n {
                    replicas.push(r.varint()?);
                }
            }
            let incarnation = if flags & 16 != 0 { r.varint()? } else { 0 };
            Command::DeclareQueue(QueueDef {
                vhost,
                name,
                durable: flags & 1 != 0,
                auto_delete: flags & 2 != 0,
                exclusive_owner,
                arguments,
                owner_node,
                owner_core,
                owner_epoch,
                replicas,
                incarnation,
            })
        }
        TAG_DELETE_QUEUE => Command::DeleteQueue { vhost: r.string()?, name: r.string()? },
        TAG_BIND | TAG_UNBIND => {
            let vhost = r.string()?;
            let source = r.string()?;
            let dest_kind = match r.u8()? {
                0 => DestKind::Queue,
                1 => DestKind::Exchange,
                _ => return Err(r.err("unknown destination kind")),
            };
            let b = Binding { vhost, source, dest_kind, dest: r.string()?, routing_key: r.string()?, arguments: r.table()? };
            if tag == TAG_BIND {
                Command::Bind(b)
            } else {
                Command::Unbind(b)
            }
        }
        TAG_CURSOR_CAS => Command::CursorCas { vhost: r.string()?, queue: r.string()?, expected: r.varint()?, new: r.varint()? },
        TAG_NODE_BOOT => Command::NodeBoot { node: r.varint()?, cluster: None },
        TAG_NODE_BOOT_CLUSTER => Command::NodeBoot { node: r.varint()?, cluster: Some(r.varint()?) },
        TAG_ENQUEUE => Command::Enqueue { vhost: r.string()?, queue: r.string()?, flags: r.u8()?, header: r.blob()?, body: r.blob()? },
        TAG_SETTLE => {
            let (vhost, queue) = (r.string()?, r.string()?);
            let n = r.varint()?;
            if n > r.buf.len() as u64 {
                return Err(r.err("offset count larger than the entry"));
            }
            let offsets = (0..n).map(|_| r.varint()).collect::<Result<Vec<u64>, _>>()?;
            Command::Settle { vhost, queue, offsets }
        }
        TAG_RETURN => {
            let (vhost, queue) = (r.string()?, r.string()?);
            let n = r.varint()?;
            if n > r.buf.len() as u64 {
                return Err(r.err("count larger than the entry"));
            }
            let mut counts = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let offset = r.varint()?;
                let count = u32::try_from(r.varint()?).map_err(|_| r.err("return count out of range"))?;
                counts.push((offset, count));
            }
            Command::Return { vhost, queue, counts }
        }
        TAG_MOVE_QUEUE => {
            Command::MoveQueue { vhost: r.string()?, queue: r.string()?, from: r.varint()?, to: r.varint()?, to_epoch: r.varint()? }
        }
        TAG_LEAVE_REPLICA_SET => Command::LeaveReplicaSet { vhost: r.string()?, queue: r.string()?, node: r.varint()? },
        TAG_RESERVE => Command::Reserve { vhost: r.string()?, queue: r.string()?, node: r.varint()?, until: r.varint()? },
        TAG_GROW_REPLICA_SET => Command::GrowReplicaSet { vhost: r.string()?, queue: r.string()?, node: r.varint()?, id: r.varint()? },
        TAG_COPY_MESSAGES => {
            let (vhost, queue, id, from, to) = (r.string()?, r.string()?, r.varint()?, r.varint()?, r.varint()?);
            let n = r.varint()?;
            if n > r.buf.len() as u64 {
                return Err(r.err("message count larger than the entry"));
            }
            let mut messages = Vec::with_capacity(n as usize);
            for _ in 0..n {
                messages.push(CopiedMessage { offset: r.varint()?, flags: r.u8()?, header: r.blob()?, body: r.blob()? });
            }
            Command::CopyMessages { vhost, queue, id, from, to, messages }
        }
        TAG_JOIN_REPLICA_SET => Command::JoinReplicaSet { vhost: r.string()?, queue: r.string()?, id: r.varint()?, tail: r.varint()? },
        TAG_SET_CLUSTER_NAME => Command::SetClusterName { name: r.string()?, permanent_id: r.string()?, initial: r.u8()? != 0 },
        TAG_LOG_COMPACTED => Command::LogCompacted { index: r.varint()? },
        32..=63 => super::access::decode(tag, r)?,
        _ => return Err(r.err("unknown command tag")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::state::tests::{args, cas, queue};
    use crate::meta::state::MetaState;
    use crate::meta::wire::field_table_to_wire;
    use amq_protocol::types::{AMQPValue, FieldTable};

    #[test]
    fn field_tables_survive_codec_and_json_exactly() {
        let mut inner = FieldTable::default();
        inner.insert("n".into(), AMQPValue::LongLongInt(-5));
        let t = args(&[
            ("x-dead-letter-exchange", AMQPValue::LongString("dlx".into())),
            ("x-nan", AMQPValue::Double(f64::NAN)),
            ("x-bytes", AMQPValue::ByteArray(vec![0u8, 255, 7].into())),
            ("x-table", AMQPValue::FieldTable(inner)),
            ("x-bool", AMQPValue::Boolean(true)),
        ]);
        let mut q = queue("q", true, Some(3));
        q.arguments = t.clone();
        let cmd = Command::DeclareQueue(q);
        let mut buf = Vec::new();
        encode_batch(1, [&cmd], &mut buf);
        let back = decode_batch(&buf).unwrap();
        let Command::DeclareQueue(back_q) = &back[0] else { panic!("wrong command") };
        // NaN != NaN, so compare wire bytes.
        assert_eq!(field_table_to_wire(&back_q.arguments), field_table_to_wire(&t));

        let mut st = MetaState::default();
        st.apply(&cmd);
        let json = serde_json::to_vec(&st).unwrap();
        let st2: MetaState = serde_json::from_slice(&json).unwrap();
        let q2 = st2.topology.queue("/", "q").unwrap();
        assert_eq!(field_table_to_wire(&q2.arguments), field_table_to_wire(&t));
    }

    #[test]
    fn replica_sets_and_incarnations_survive_and_logs_from_before_them_still_read() {
        let mut q = queue("q", true, None);
        q.replicas = vec![1, 3, 4];
        q.incarnation = u64::MAX - 5;
        let cmd = Command::DeclareQueue(q.clone());
        let mut buf = Vec::new();
        encode_batch(1, [&cmd], &mut buf);
        assert_eq!(decode_batch(&buf).unwrap(), vec![cmd]);

        // A declare as written before replica sets: flags without bit 3, nothing after the
        // epoch. It reads as "every member".
        let old = [1u8, 1, TAG_DECLARE_QUEUE, 1, b'/', 1, b'q', 1, 0, 2, 7, 9];
        let Command::DeclareQueue(d) = &decode_batch(&old).unwrap()[0] else { panic!("wrong command") };
        assert_eq!((d.owner_node, d.owner_core, d.owner_epoch, d.durable), (2, 7, 9, true));
        assert!(d.replicas.is_empty() && d.stored_on(5) && d.incarnation == 0);
        let mut without = Vec::new();
        q.replicas.clear();
        q.incarnation = 0;
        encode_batch(1, [&Command::DeclareQueue(q)], &mut without);
        assert_eq!(
            without,
            [1u8, 1, TAG_DECLARE_QUEUE, 1, b'/', 1, b'q', 1, 0, 1, 0, 1],
            "a queue without a replica set is written as before"
        );

        // A snapshot from before replica sets (no "replicas" key) loads too.
        let mut st = MetaState::default();
        st.apply(&Command::DeclareQueue(queue("q", true, None)));
        let json = serde_json::to_string(&st).unwrap().replace(",\"replicas\":[]", "").replace(",\"incarnation\":0", "");
        assert!(!json.contains("replicas") && !json.contains("incarnation"));
        let back: MetaState = serde_json::from_str(&json).unwrap();
        assert!(back.topology.queue("/", "q").unwrap().replicas.is_empty());
    }

    #[test]
    fn decode_rejects_garbage() {
        assert!(decode_batch(&[]).is_err());
        assert!(decode_batch(&[9]).is_err());
        assert!(decode_batch(&[1, 1, 200]).is_err());
        assert!(decode_batch(&[1, 5, 9]).is_err());
        let mut buf = Vec::new();
        encode_batch(1, [&cas("q", 1, 2)], &mut buf);
        buf.push(0);
        assert!(decode_batch(&buf).is_err(), "trailing byte");
        buf.pop();
        buf.pop();
        assert!(decode_batch(&buf).is_err(), "truncated");
    }
}
