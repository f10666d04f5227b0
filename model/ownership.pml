/*
 * The shardrun ownership protocol, for spin.
 *
 * The unit of ownership is a shard of a capability group (shard.GroupOf):
 * the runners that serve the same queues and handle the same kinds. Each
 * runner has one lease and one owner key, owners/<group>/<runner>, naming
 * the shards it holds in its group with their epochs; it acquires with a
 * put conditioned on no key of its group having changed since its view.
 * Each unit has its fence in PostgreSQL (shard_fences keyed (grp, shard)).
 *
 * By default (GROUPS 0) one group of two runners shares one shard whose one
 * task they execute; with GROUPS 1, runners 0 and 1 form group A and
 * runner 2 group B, each group owns the shard on its own, and the shard
 * has two tasks: task 0 of a kind only A handles, task 1 of a kind both
 * handle (a lane both groups claim from). Time is discrete: every global
 * tick, etcd counts leases down and each runner's local clock advances (or,
 * for a slow clock, may lag within a bound). All deadlines are kept as
 * countdowns relative to now, so the state space is finite.
 * model/README.md maps every process and variable to the Go code.
 *
 * Parameters (spin -D...):
 *   TTL      lease TTL in ticks                          (shard.Config.LeaseTTL)
 *   MARGIN   detach at deadline - MARGIN                 (shard.Config.DetachMargin)
 *   LAG      how far a runner's clock may fall behind real time over one
 *            keep-alive interval (clock-rate error x TTL)
 *   PAUSE    longest process pause (GC, SIGSTOP): the ticks at which the
 *            paused runner takes no step and its timer does not fire
 *   WINDOW   recovery window, in ticks                   (detach.Config.RecoveryWindow)
 *   FAULTS   1: keep-alives may be lost or delayed, runners paused, detached
 *            by hand; 0: none of that, keep-alives on schedule (Progress)
 *   FAULTY   which runners the faults hit, a bit mask (default: all)
 *   DELAYS   0: a keep-alive the faults hit is lost, never delayed across
 *            a tick
 *   KA_FAULTS 0: no keep-alive is lost or delayed (the other faults remain)
 *   RECEIPT_BUG  1: the deadline counts from the keep-alive's receipt
 *            instead of its send time (the mistake the design warns about)
 *   SPLIT_RAISE 1: the new owner raises the fence and requeues the orphans
 *            in two transactions instead of one (the writes, which match
 *            the claim row and take no lock on the fence, then land between)
 *   CLAIM_NOLOCK 1: claims check the fence and take the task in two steps,
 *            as without the FOR SHARE lock on the fence row
 *   MANUAL   1: an operator may detach each runner by hand once, and attach it
 *   IDLE_PAUSE 1: pauses start only while the runner executes nothing, to
 *            check new work alone: a runner waking from any pause must
 *            start nothing past its detach point
 *   CLAIM_NO_CLOCK 1: claims check only the detach flag, not the lease
 *            clock (the mistake that let a woken runner start work before
 *            its timer detached it)
 *   MAXACQ   acquisitions explored, per group (revisions only grow; this
 *            bounds them)
 *   GROUPS   1: two capability groups (three runners, two tasks), above
 *   ONLY_B   1 (GROUPS): group A's runners are stopped by an operator from
 *            the start and never attach: only task 1 can run
 * The weakened group protocols (GROUPS 1):
 *   OWN_KEY_ONLY 1: an acquisition is conditioned on the runner's own key
 *            only, not on every owner key of its group
 *   SHARED_FENCE 1: one fence per shard for all groups (shard_fences keyed
 *            by shard alone), and a raise requeues every older claim of the
 *            shard, whatever its group
 *   CLAIM_UNOWNED 1: group B's runner claims without holding its group's
 *            unit (from a shard B's unit is not its in)
 *   CLAIM_ANY_KIND 1: claims take the lanes of every kind, not only those
 *            of the runner's kinds
 */

#ifndef TTL
#define TTL 5
#endif
#ifndef MARGIN
#define MARGIN 2
#endif
#ifndef LAG
#define LAG 0
#endif
#ifndef PAUSE
#define PAUSE 0
#endif
#ifndef WINDOW
#define WINDOW 1
#endif
#ifndef FAULTS
#define FAULTS 1
#endif
#ifndef FAULTY
#define FAULTY 7
#endif
#ifndef DELAYS
#define DELAYS 1
#endif
#ifndef KA_FAULTS
#define KA_FAULTS 1
#endif
#ifndef ONLY_B
#define ONLY_B 0
#endif
#ifndef RECEIPT_BUG
#define RECEIPT_BUG 0
#endif
#ifndef SPLIT_RAISE
#define SPLIT_RAISE 0
#endif
#ifndef CLAIM_NOLOCK
#define CLAIM_NOLOCK 0
#endif
#ifndef MANUAL
#define MANUAL 0
#endif
#ifndef IDLE_PAUSE
#define IDLE_PAUSE 0
#endif
#ifndef CLAIM_NO_CLOCK
#define CLAIM_NO_CLOCK 0
#endif
#ifndef MAXACQ
#define MAXACQ 2
#endif
#ifndef GROUPS
#define GROUPS 0
#endif
#ifndef OWN_KEY_ONLY
#define OWN_KEY_ONLY 0
#endif
#ifndef SHARED_FENCE
#define SHARED_FENCE 0
#endif
#ifndef CLAIM_UNOWNED
#define CLAIM_UNOWNED 0
#endif
#ifndef CLAIM_ANY_KIND
#define CLAIM_ANY_KIND 0
#endif
#define PERIOD 1   /* keep-alive interval in ticks (TTL/3 rounded down, at least 1) */

#if GROUPS && CLAIM_NOLOCK
#error CLAIM_NOLOCK is a check of the one-group model
#endif

#define FREE 255

/* Runners, tasks and groups. GRP(i) is runner i's group; CAN_RUN(g, t):
 * group g handles the kind of task t (serves its queue, has its handler). */
#if GROUPS
#define N  3
#define NT 2
#define NG 2
#define GRP(i) grp[i]
#define CAN_RUN(g, t) ((g) == 0 || (t) == 1)
#else
#define N  2
#define NT 1
#define NG 1
#define GRP(i) 0
#define CAN_RUN(g, t) true
#endif

/* The fence a unit's claims and raises use: the unit's own, or, weakened,
 * the shard's one fence. */
#if SHARED_FENCE
#define FI(g) 0
#define SAME_UNIT(g, h) true
#else
#define FI(g) (g)
#define SAME_UNIT(g, h) ((g) == (h))
#endif

/* Task states (tasks.State). */
#define READY   0
#define RUNNING 1
#define DONE    2

/* Keep-alive in flight (shard/keeper.go): none, request on its way to
 * etcd, response on its way back, "lease not found" on its way back. */
#define KA_NONE 0
#define KA_REQ  1
#define KA_RESP 2
#define KA_GONE 3

/* ---- etcd ---- */
byte lease_left[N];       /* server ticks until the runner's lease expires; 0: expired */
byte okey[N];             /* owners/<group>/<runner i>: the epoch it names shard 0 with
                           * (the revision of the put that added it), 0: names nothing
                           * (with one shard: no key). With one shard it is also the
                           * key's ModRevision. */
byte rev;                 /* etcd's revision counter, counting the puts (a delete
                           * changes no key's ModRevision, so no comparison sees it) */
#if GROUPS
byte acq[NG];             /* acquisitions per group, bounded by MAXACQ */
#endif

/* ---- PostgreSQL ---- */
byte fence[NG];           /* shard_fences.epoch of unit (group, shard 0) */
byte task_state[NT];      /* READY: a task_ready entry; RUNNING: a task_claims row */
byte task_epoch[NT];      /* task_claims.epoch (a requeue always comes with a new
                           * epoch here, so the epoch stands in for the attempt) */
byte task_owner[NT];      /* task_claims.owner */
byte task_grp[NT];        /* task_claims.grp: the unit it was claimed under */
byte outcomes[NT];        /* terminal outcomes recorded */

/* ---- runners ---- */
bool attached[N];         /* detach.Machine: !IsDetached() */
bool sticky[N];           /* manual detach waiting for Attach */
byte dl[N];               /* local countdown to the lease deadline (LeaseClock.Deadline);
                           * every value at or below MARGIN means "detach now" and is kept as 0 */
byte ka[N];               /* keep-alive in flight */
byte ka_age[N];           /* local ticks since that keep-alive was sent, capped at TTL - MARGIN
                           * (an answer that old cannot keep the runner attached) */
byte since_send[N];       /* local ticks since the last send (the keep-alive timer) */
byte lag_d[N];            /* clock lag since the send that set the deadline */
byte lag_r[N];            /* clock lag since the send of the keep-alive in flight */
byte paused[N];           /* ticks of pause left */
byte healthy[N];          /* consecutive healthy ticks while detached */
bool owns[N];             /* holds its group's unit (a term in the ledger) */
byte epoch[N];            /* its epoch */
bool fenced[N];           /* raised the fence for it (executor.fenced) */
bool requeued[N];         /* requeued the orphans of older epochs */
bool ex[N * NT];          /* ex[i*NT + t]: a handler of task t is running on runner i */
byte cl_epoch[N * NT];    /* epoch of the claim it runs */
bool checked[N * NT];     /* CLAIM_NOLOCK: read the fence, about to take the task */
bool manual_used[N];      /* the one manual detach per runner was used */
bool can_pause[N];        /* the timer has run since the last pause, so a new
                           * pause may start (pauses do not chain into longer ones) */
#if GROUPS
byte grp[N];              /* the runner's group (constant: 0, 0, 1) */
bool vfree[N];            /* the runner's view of its group's owner keys (as of
                           * Manager.groupRev) names no holder of the unit; kept
                           * false while the runner holds the unit (it acquires
                           * nothing then) */
#endif

/* The properties, each asserted where it can become false (a named
 * variable, so that a counterexample says which). */
bool NoDoubleExecution = true, NoStaleWrite = true, OutcomeOnce = true, RunsWhereItCan = true;

#define EXEC(i, t) ex[(i) * NT + (t)]
#define ATT_EXEC(i, t) (attached[i] && EXEC(i, t))

/* NoDoubleExecution: never two attached runners executing one task at
 * once. It can only become false at a claim of that task (every other step
 * clears attached or ex, and re-attaching requires owning nothing, hence
 * running nothing), so asserting it after each claim checks it in every
 * state. */
#if GROUPS
#define double_exec(t) ((ATT_EXEC(0, t) && ATT_EXEC(1, t)) || (ATT_EXEC(0, t) && ATT_EXEC(2, t)) || \
                        (ATT_EXEC(1, t) && ATT_EXEC(2, t)))
#else
#define double_exec(t) (ATT_EXEC(0, t) && ATT_EXEC(1, t))
#endif
#ifdef NO_DOUBLE_EXEC_CHECK
#define check_double_exec(t) skip
#else
#define check_double_exec(t) NoDoubleExecution = !double_exec(t); assert(NoDoubleExecution)
#endif

/* NoStaleWrite: no write lands with an epoch older than the fence of the
 * unit its claim was made under. */
#ifdef NO_STALE_WRITE_CHECK
#define check_stale_write(i, t) skip
#else
#define check_stale_write(i, t) NoStaleWrite = (cl_epoch[(i) * NT + (t)] >= fence[FI(task_grp[t])]); assert(NoStaleWrite)
#endif

/* Whether runner i executes nothing; whether every task is done. */
#if GROUPS
#define IDLE(i) (!EXEC(i, 0) && !EXEC(i, 1))
#define ALL_DONE (task_state[0] == DONE && task_state[1] == DONE)
#if ONLY_B
#define RUNNABLE_DONE (task_state[1] == DONE)
#else
#define RUNNABLE_DONE ALL_DONE
#endif
#else
#define IDLE(i) (!EXEC(i, 0))
#define ALL_DONE (task_state[0] == DONE)
#define RUNNABLE_DONE ALL_DONE
#endif

/* Faults hit runner i. PROMPT: no keep-alive of a runner they do not hit
 * is in flight. */
#define FAULTY_RUNNER(i) (FAULTS && ((FAULTY >> (i)) & 1))
#define DELAYED(i) (KA_FAULTS && DELAYS && FAULTY_RUNNER(i))
#if GROUPS
#define PROMPT ((DELAYED(0) || ka[0] == KA_NONE) && (DELAYED(1) || ka[1] == KA_NONE) && \
                (DELAYED(2) || ka[2] == KA_NONE))
#else
#define PROMPT ((DELAYED(0) || ka[0] == KA_NONE) && (DELAYED(1) || ka[1] == KA_NONE))
#endif

/* No key of group g names the unit. */
#if GROUPS
#define GFREE(g) ((grp[0] != (g) || okey[0] == 0) && (grp[1] != (g) || okey[1] == 0) && (grp[2] != (g) || okey[2] == 0))
#else
#define GFREE(g) (okey[0] == 0 && okey[1] == 0)
#endif

/* The acquiring Txn's comparison, made on a view that named no holder of
 * the unit: no owner key of runner i's group was put after the view
 * (ModRevision of the prefix < groupRev + 1). With one shard a key exists
 * only while it names the unit, so that view held no key of the group, every
 * key of the group that exists now was put after it, and the comparison
 * holds exactly when the unit is free now (a stale view fails it). Weakened:
 * the runner's own key alone, which it does not have. */
#if OWN_KEY_ONLY
#define UNCHANGED(i) (okey[i] == 0)
#else
#define UNCHANGED(i) GFREE(GRP(i))
#endif

/* What a claim requires of the unit: the runner holds its group's unit,
 * raised its fence and requeued the orphans, and the fence still has its
 * epoch (the FOR SHARE lock on the fence row where (shard, epoch, owner)
 * match). */
#define OWN_UNIT(i) (owns[i] && requeued[i] && fence[FI(GRP(i))] == epoch[i])
#if CLAIM_UNOWNED
#define CLAIM_UNIT(i) (GRP(i) == 1 || OWN_UNIT(i))
#else
#define CLAIM_UNIT(i) OWN_UNIT(i)
#endif
#if CLAIM_ANY_KIND
#define RUNS(i, t) true
#else
#define RUNS(i, t) CAN_RUN(GRP(i), t)
#endif

/* requeue(i): the orphans of runner i's unit (claims of its group, on the
 * shard) of epochs older than runner i's go back to ready. */
inline requeue_task(i, t) {
	if
	:: task_state[t] == RUNNING && SAME_UNIT(task_grp[t], GRP(i)) && task_epoch[t] < epoch[i] ->
		task_state[t] = READY; task_owner[t] = FREE; task_grp[t] = 0
	:: else
	fi
}
inline requeue(i) {
	requeue_task(i, 0);
#if GROUPS
	requeue_task(i, 1);
#endif
	requeued[i] = true
}

/* detach(i): the subscriber cancels every term's work at once. */
inline detach(i) {
	attached[i] = false;
	stop_all(i);
	healthy[i] = 0
}

/* The handler of task t is cancelled or done: its claim is forgotten. */
inline stop_exec(i, t) {
	EXEC(i, t) = false;
	cl_epoch[(i) * NT + (t)] = 0
}
inline stop_all(i) {
	stop_exec(i, 0)
#if GROUPS
	; stop_exec(i, 1)
#endif
}

/* The runner no longer holds the unit. */
inline drop(i) {
	owns[i] = false;
	epoch[i] = 0;
	fenced[i] = false;
	requeued[i] = false
}

/* Keep-alive finished (answered, lost or abandoned). */
inline ka_done(i) {
	ka[i] = KA_NONE;
	ka_age[i] = 0;
	lag_r[i] = 0
}

/* One tick of time for runner i's local clock: it advances by one, or, for
 * a slow clock within the lag bound, not at all. */
inline local_tick(i) {
	if
	:: lag_d[i] < LAG && (ka[i] == KA_NONE || lag_r[i] < LAG) ->
		lag_d[i]++;
		if :: ka[i] != KA_NONE -> lag_r[i]++ :: else fi
	:: true ->
		if :: dl[i] > MARGIN + 1 -> dl[i]-- :: else -> dl[i] = 0 fi;
		if :: ka[i] != KA_NONE && ka_age[i] < TTL - MARGIN -> ka_age[i]++ :: else fi;
		if :: since_send[i] < PERIOD -> since_send[i]++ :: else fi
	fi
}

/* etcd expires a lease no earlier than TTL after it received the last
 * keep-alive, and deletes the keys attached to it: the runner's owner key. */
inline server_tick(i) {
	if
	:: lease_left[i] > 0 ->
		lease_left[i]--;
		if :: lease_left[i] == 0 -> okey[i] = 0 :: else fi
	:: else
	fi
}

/* The runner's timer fires at deadline - MARGIN (keeper.check), unless the
 * process is paused; recovery counts healthy ticks (detach.Machine). */
inline runner_timers(i) {
	if
	:: paused[i] > 0 -> paused[i]--
	:: else ->
		can_pause[i] = true;              /* a pause ended: the timer ran once */
		if :: attached[i] && dl[i] == 0 -> detach(i) :: else fi;
		/* the keep-alive timer: one request every PERIOD local ticks */
		if
		:: ka[i] == KA_NONE && since_send[i] >= PERIOD ->
			ka[i] = KA_REQ; ka_age[i] = 0; since_send[i] = 0; lag_r[i] = 0
		:: else
		fi;
		if
		:: !attached[i] && dl[i] != 0 && healthy[i] < WINDOW -> healthy[i]++
		:: !attached[i] && dl[i] == 0 -> healthy[i] = 0
		:: else
		fi
	fi
}

active proctype clock() {
	do
	:: atomic {
		/* without faults the network is prompt: no keep-alive is in flight
		 * across a tick */
		PROMPT;
		/* once every task is done nothing that follows can break a
		 * property: time stops (pan -E: stopping is not a deadlock) */
		!ALL_DONE;
		server_tick(0); server_tick(1);
#if GROUPS
		server_tick(2);
#endif
		local_tick(0); local_tick(1);
#if GROUPS
		local_tick(2);
#endif
		runner_timers(0); runner_timers(1)
#if GROUPS
		; runner_timers(2)
#endif
	}
	od
}

/* The network and the environment of runner i: keep-alive requests and
 * responses arrive (or, with faults, are lost or delayed), the process is
 * paused, an operator detaches it. */
proctype network(byte i) {
	do
	:: atomic { ka[i] == KA_REQ ->          /* etcd receives the keep-alive */
		if
		:: lease_left[i] > 0 -> lease_left[i] = TTL; ka[i] = KA_RESP
		:: else -> ka[i] = KA_GONE
		fi }
#if FAULTS
	:: atomic { KA_FAULTS && FAULTY_RUNNER(i) && ka[i] == KA_REQ -> ka_done(i) }   /* request lost, or the call timed out */
	:: atomic { KA_FAULTS && FAULTY_RUNNER(i) && ka[i] == KA_RESP -> ka_done(i) }  /* response lost */
#endif
	:: atomic { paused[i] == 0 && ka[i] == KA_RESP ->  /* response: deadline = send + TTL */
#if RECEIPT_BUG
		dl[i] = TTL;
#else
		if :: ka_age[i] < TTL - MARGIN -> dl[i] = TTL - ka_age[i] :: else -> dl[i] = 0 fi;
#endif
		lag_d[i] = lag_r[i];
		ka_done(i) }
	:: atomic { paused[i] == 0 && ka[i] == KA_GONE ->  /* lease gone: detach, grant a new one */
		detach(i);
		drop(i);
		lease_left[i] = TTL; dl[i] = TTL; lag_d[i] = 0;
		ka_done(i) }
#if FAULTS && PAUSE > 0
	:: atomic { FAULTY_RUNNER(i) && paused[i] == 0 && can_pause[i] && (!IDLE_PAUSE || IDLE(i)) ->
		paused[i] = PAUSE; can_pause[i] = false }  /* GC pause, SIGSTOP: PAUSE ticks of timer checks missed */
#endif
#if FAULTS && MANUAL
	/* POST /admin/detach, then /admin/attach: once per runner (it only
	 * detaches; more rounds add states, not behaviours) */
	:: atomic { FAULTY_RUNNER(i) && attached[i] && !sticky[i] && !manual_used[i] -> sticky[i] = true; manual_used[i] = true; detach(i) }
	:: atomic { sticky[i] -> sticky[i] = false }
#endif
	od
}

/* Claim task t and begin it under a Hold: attached, and the lease clock
 * before its detach point (dl != 0), checked by the claim itself and not
 * left to the timer (shard.Manager.mayWork); only a lane of the runner's
 * kinds, in a shard whose unit of its group it holds, fenced (Store.Claim,
 * under FOR SHARE of the unit's fence row). The lane entry is deleted by
 * one claim: the step is atomic on it. */
inline claim(i, t) {
	atomic { paused[i] == 0 && attached[i] && (CLAIM_NO_CLOCK || dl[i] != 0) &&
	         CLAIM_UNIT(i) && RUNS(i, t) && !EXEC(i, t) && task_state[t] == READY ->
		task_state[t] = RUNNING; task_epoch[t] = epoch[i]; task_owner[t] = i; task_grp[t] = GRP(i);
		EXEC(i, t) = true; cl_epoch[(i) * NT + (t)] = epoch[i];
		RunsWhereItCan = CAN_RUN(GRP(i), t); assert(RunsWhereItCan);
		check_double_exec(t) }
}

/* Without the lock the claim reads the fence, then takes the task: the
 * raise and requeue can land in between. */
inline claim_nolock(i, t) {
	atomic { paused[i] == 0 && attached[i] && (CLAIM_NO_CLOCK || dl[i] != 0) &&
	         OWN_UNIT(i) && RUNS(i, t) && !EXEC(i, t) && !checked[(i) * NT + (t)] ->
		checked[(i) * NT + (t)] = true }
}
inline take_checked(i, t) {
	atomic { checked[(i) * NT + (t)] ->
		if
		:: task_state[t] == READY ->
			task_state[t] = RUNNING; task_epoch[t] = epoch[i]; task_owner[t] = i; task_grp[t] = GRP(i);
			EXEC(i, t) = true; cl_epoch[(i) * NT + (t)] = epoch[i];
			check_double_exec(t)
		:: else
		fi;
		checked[(i) * NT + (t)] = false }
}

/* Complete: matches the claim row (owner, epoch, attempt) and takes no
 * lock on the fence; one statement, atomic on that row. A refusal means
 * the unit's fence moved on (FenceLost): the term is cancelled. */
inline complete(i, t) {
	atomic { paused[i] == 0 && EXEC(i, t) ->
		if
		:: task_state[t] == RUNNING && task_owner[t] == i && task_epoch[t] == cl_epoch[(i) * NT + (t)] ->
			check_stale_write(i, t);
			task_state[t] = DONE; outcomes[t]++;
			OutcomeOnce = (outcomes[t] <= 1); assert(OutcomeOnce)
		:: else -> drop(i); stop_all(i)
		fi;
		stop_exec(i, t) }
}

/* Runner i's own work: re-attaching, ownership of its group's unit and the
 * executor. A separate process from its network, so that weak fairness
 * makes it take its enabled steps. */
proctype worker(byte i) {
	do
	/* ---- re-attach after the recovery window (detach.Machine.Healthy) ---- */
	:: atomic { paused[i] == 0 && !attached[i] && !sticky[i] && healthy[i] >= WINDOW && dl[i] != 0 && !owns[i] ->
		attached[i] = true; healthy[i] = 0 }

	/* ---- ownership of the unit (shard/reconcile.go) ---- */
#if GROUPS
	/* The watch brings the view of the group's owner keys up to date
	 * (Manager.apply: groupRev is the revision it is complete up to). */
	:: atomic { paused[i] == 0 && !owns[i] && vfree[i] != GFREE(GRP(i)) ->
		vfree[i] = GFREE(GRP(i)) }
	/* Manager.acquire: the unit is assigned to this runner and free in its
	 * view; Txn: if no owner key of the group changed since the view, put
	 * the runner's key naming the shard (epoch: this revision), else read
	 * the group's keys. */
	:: atomic { paused[i] == 0 && attached[i] && !owns[i] && vfree[i] && lease_left[i] > 0 && acq[GRP(i)] < MAXACQ ->
		if
		:: UNCHANGED(i) ->
			rev++; acq[GRP(i)]++; okey[i] = rev; vfree[i] = false;
			owns[i] = true; epoch[i] = rev; fenced[i] = false; requeued[i] = false
		:: else -> vfree[i] = GFREE(GRP(i))
		fi }
#else
	/* Manager.acquire with an up-to-date view, in one step: no owner key of
	 * the group names the unit; put the runner's key naming it. (A Txn on a
	 * stale view fails and only reads the keys; one that applies found no
	 * key put since the view, so the unit its view showed free is free.) */
	:: atomic { paused[i] == 0 && attached[i] && !owns[i] && GFREE(0) && lease_left[i] > 0 && rev < MAXACQ ->
		rev++; okey[i] = rev;
		owns[i] = true; epoch[i] = rev; fenced[i] = false; requeued[i] = false }
#endif
	:: atomic { paused[i] == 0 && owns[i] && okey[i] != epoch[i] ->
		drop(i); stop_all(i) }                      /* dropVanished: the key no longer names the term */
	:: atomic { paused[i] == 0 && !attached[i] && owns[i] ->
		if                                          /* release: put the key without the shard */
		:: okey[i] == epoch[i] -> okey[i] = 0
		:: else
		fi;
#if GROUPS
		vfree[i] = GFREE(GRP(i));                   /* the Txn's answer brings the view up to date */
#endif
		drop(i) }

	/* ---- the executor (executor/claimer.go, store/moves.go) ---- */
	/* RaiseFences: raise the unit's fence and, in the same transaction,
	 * requeue the unit's claims of older epochs (the orphans) */
	:: atomic { paused[i] == 0 && attached[i] && owns[i] && !fenced[i] ->
		if
		:: fence[FI(GRP(i))] <= epoch[i] -> fence[FI(GRP(i))] = epoch[i]; fenced[i] = true;
#if !SPLIT_RAISE
			requeue(i)
#endif
		:: else -> drop(i)                          /* FenceLost */
		fi }
#if SPLIT_RAISE
	:: atomic { paused[i] == 0 && attached[i] && owns[i] && fenced[i] && !requeued[i] ->
		if                                          /* the requeue, a transaction of its own */
		:: fence[FI(GRP(i))] == epoch[i] -> requeue(i)
		:: else -> drop(i)
		fi }
#endif
#if CLAIM_NOLOCK
	:: claim_nolock(i, 0)
	:: take_checked(i, 0)
#else
	:: claim(i, 0)
#if GROUPS
	:: claim(i, 1)
#endif
#endif
	:: complete(i, 0)
#if GROUPS
	:: complete(i, 1)
#endif
	od
}

init {
	atomic {
		byte i = 0;
		do
		:: i < N -> lease_left[i] = TTL; dl[i] = TTL; attached[i] = true; can_pause[i] = true; i++
		:: else -> break
		od;
#if GROUPS
		grp[2] = 1;
#endif
#if ONLY_B
		attached[0] = false; sticky[0] = true;
		attached[1] = false; sticky[1] = true;
#endif
		i = 0;
		do
		:: i < NT -> task_owner[i] = FREE; i++
		:: else -> break
		od;
		run network(0); run worker(0);
		run network(1); run worker(1);
#if GROUPS
		run network(2); run worker(2);
#endif
		i = 0
	}
}

/* Progress: with no faults and keep-alives on schedule, every task some
 * attached runner can run is eventually completed (check with weak
 * fairness). */
ltl Progress { <> RUNNABLE_DONE }
