# Session 23: leave-one-step-out error of the time model fit (usage: python THIS SWEEPS.json [--old-form],
# repo root; --old-form: the records without depth, merge and room, i.e. the form before session 23 under
# the same fit)
import json, sys, numpy as np
from pkvrt.tools import sweeps
from pkvrt.policy import calibration as C
from pkvrt.policy.registry import load_routes
from pkvrt.policy.costmodel import fit_route_time, measured_us, route_groups
cal=C.load_calibration('calibration/nvidia-h200.json'); reg=load_routes(None)
timed=sweeps.read_rows(json.load(open(sys.argv[1]))['rows'])
for g in (4,1,8):
    for kind in ('fused','workqueue','flashinfer'):
        steps=[t for t in timed if t.kind==kind and t.group==g]
        worst=(0,None)
        for t in steps:
            recs=sweeps.fit_records([s for s in steps if s is not t], cal, reg, kind, g)
            if '--old-form' in sys.argv:
                recs=[{k: v for k, v in r.items() if k not in ('depth_tiles', 'merge_per_sm', 'room_tiles')} for r in recs]
            rt=fit_route_time(recs, beta_gbps=cal.beta_gbps)
            route=sweeps.route_of_kind(reg,kind); view=t.view(cal)
            cut=sweeps.planned_cut(t,route,view)
            if cut not in t.times: continue
            kw=dict(splits=route.splits) if kind!='flashinfer' else {}
            grp=route_groups(kind,t.seq,view,**kw,**t.shape)
            e=measured_us(grp,rt,view,graphs=True)/t.times[cut]-1
            if abs(e)>worst[0]: worst=(abs(e),t.case)
        print(g,kind,'LOO worst %.1f%% (%s)'%(100*worst[0],worst[1]))
