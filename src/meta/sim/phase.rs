//! The phases of a run (sim.rs module doc, "Phases"): chaos with its faults, then calm and
//! the liveness check (invariant 5).

use raft::StateRole;

use super::{workload, Phase, Sim, CALM_MS, MAX_PAUSE_MS, PROBE_MS};
use crate::meta::topology::NodeId;

impl Sim {
    /// Moves the phase on (sim.rs, "One step", step 2).
    pub(super) fn phase_step(&mut self) -> Result<(), String> {
        match &mut self.phase {
            Phase::Chaos { until } => {
                if self.t >= *until || self.step >= self.steps {
                    self.net.heal();
                    self.phase = Phase::Calm { since: self.t };
                    self.event("calm: network healed".into());
                    for i in 0..self.nodes.len() {
                        self.nodes[i].paused_until = None;
                        if self.nodes[i].driver.is_none() {
                            self.open(i)?;
                        }
                    }
                } else if self.rng.chance(self.fault_pm) {
                    self.fault()?;
                }
            }
            Phase::Calm { since } => {
                if self.t >= *since + CALM_MS {
                    self.check_leader()?;
                    let mut probes = Vec::new();
                    let mut names = Vec::new();
                    for i in 0..self.nodes.len() {
                        let name = format!("probe-{}-{}", self.stats.calm_checks, self.nodes[i].id);
                        probes.push((self.probe(i, &name), false));
                        names.push(name);
                    }
                    self.stats.calm_checks += 1;
                    self.net.lossless = true;
                    self.phase = Phase::Probe { since: self.t, probes, names };
                }
            }
            Phase::Probe { .. } => self.probe_step()?,
        }
        Ok(())
    }

    /// Invariant 5, first half: one leader, known to all at one term.
    fn check_leader(&mut self) -> Result<(), String> {
        let views: Vec<(NodeId, u64, NodeId, StateRole)> = self
            .nodes
            .iter()
            .filter_map(|n| n.driver.as_ref().map(|d| (n.id, d.raw.raft.term, d.raw.raft.leader_id, d.raw.raft.state)))
            .collect();
        let leaders: Vec<_> = views.iter().filter(|v| v.3 == StateRole::Leader).collect();
        let ok = views.len() == self.nodes.len() && leaders.len() == 1 && views.iter().all(|v| v.2 == leaders[0].0 && v.1 == leaders[0].1);
        if !ok {
            return Err(format!("no stable leader {CALM_MS} ms after healing: (node, term, leader, role) = {views:?}"));
        }
        self.event(format!("calm: leader {} in term {}", leaders[0].0, leaders[0].1));
        Ok(())
    }

    /// Invariant 5, second half: every probe answered and visible on every node in time.
    fn probe_step(&mut self) -> Result<(), String> {
        let Phase::Probe { since, mut probes, names } = std::mem::replace(&mut self.phase, Phase::Calm { since: 0 }) else {
            return Ok(());
        };
        for (p, answered) in probes.iter_mut().filter(|(_, a)| !*a) {
            match self.poll(p)? {
                None => {}
                Some(workload::Answer::Ok(_)) => *answered = true,
                Some(workload::Answer::Failed(e)) => return Err(format!("probe {:?} failed after healing: {e}", p.cmds)),
            }
        }
        let visible = self.nodes.iter().all(|n| {
            n.driver.as_ref().is_some_and(|d| {
                let st = d.shared.state.lock();
                names.iter().all(|x| st.topology.exchange("/", x).is_some())
            })
        });
        if probes.iter().all(|(_, a)| *a) && visible {
            self.event(format!("calm: probes committed in {} ms", self.t - since));
            if self.step >= self.steps {
                self.done = true;
            } else {
                let until = self.t + self.rng.range(10_000, 25_000);
                self.phase = Phase::Chaos { until };
                self.net.lossless = false;
                self.event("chaos".into());
            }
            return Ok(());
        }
        if self.t > since + PROBE_MS {
            let answered: Vec<bool> = probes.iter().map(|(_, a)| *a).collect();
            let logged: Vec<bool> = names.iter().map(|x| self.check.model().topology.exchange("/", x).is_some()).collect();
            return Err(format!(
                "liveness: probes {names:?} not committed everywhere within {PROBE_MS} ms (answered {answered:?}, in the log {logged:?}); {}",
                self.describe_nodes()
            ));
        }
        self.phase = Phase::Probe { since, probes, names };
        Ok(())
    }

    /// Every node's Raft view, for a failure message.
    fn describe_nodes(&self) -> String {
        let views: Vec<String> = self
            .nodes
            .iter()
            .map(|n| match &n.driver {
                None => format!("node {}: down", n.id),
                Some(d) => {
                    let r = &d.raw.raft;
                    format!(
                        "node {}: {:?} term {} leader {} commit {} applied {} last {} snapshot {}, {} entries in flight",
                        n.id,
                        r.state,
                        r.term,
                        r.leader_id,
                        r.raft_log.committed,
                        n.applied,
                        r.raft_log.last_index(),
                        d.raw.store().snapshot_index(),
                        d.in_flight.len()
                    ) + &if r.state == StateRole::Leader {
                        format!(", progress {:?}", r.prs().iter().collect::<std::collections::BTreeMap<_, _>>())
                    } else {
                        String::new()
                    }
                }
            })
            .collect();
        views.join("; ")
    }

    fn random_node(&mut self) -> usize {
        self.rng.below(self.nodes.len() as u64) as usize
    }

    /// The node a fault strikes: the leader half of the time (when one is up), else any.
    fn target(&mut self) -> usize {
        let leader = self.nodes.iter().position(|n| n.driver.as_ref().is_some_and(|d| d.raw.raft.state == StateRole::Leader));
        match leader {
            Some(l) if self.rng.chance(500) => l,
            _ => self.random_node(),
        }
    }

    fn fault(&mut self) -> Result<(), String> {
        let mut ids: Vec<NodeId> = self.nodes.iter().map(|n| n.id).collect();
        let n = ids.len();
        let x = self.target();
        match self.rng.below(100) {
            0..=14 => {
                let lone = ids.remove(x);
                self.net.split(&[lone], &ids);
                self.event(format!("isolate {lone}"));
            }
            15..=29 => {
                self.rng.shuffle(&mut ids);
                let k = self.rng.range(1, (n as u64 - 1) / 2) as usize;
                self.net.split(&ids[..k], &ids[k..]);
                self.event(format!("split {:?} | {:?}", &ids[..k], &ids[k..]));
            }
            30..=37 => {
                let y = (x + 1 + self.rng.below(n as u64 - 1) as usize) % n;
                let (a, b) = if self.rng.chance(500) { (x, y) } else { (y, x) };
                self.net.cut_one(ids[a], ids[b]);
                self.event(format!("cut {} -> {} (cut: {})", ids[a], ids[b], self.net.describe_cuts()));
            }
            38..=57 => {
                if self.net.any_cut() {
                    self.net.heal();
                    self.event("heal".into());
                }
            }
            58..=69 => self.crash(x, None)?,
            70..=79 => {
                let ms = self.rng.range(300, 12_000);
                self.crash(x, Some(ms))?;
            }
            _ => {
                if self.nodes[x].driver.is_some() && self.nodes[x].paused_until.is_none() {
                    let ms = self.rng.range(200, MAX_PAUSE_MS);
                    self.nodes[x].paused_until = Some(self.t + ms);
                    self.event(format!("node {} pauses for {ms} ms", ids[x]));
                }
            }
        }
        Ok(())
    }
}
