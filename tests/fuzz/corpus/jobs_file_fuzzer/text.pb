jobs { job_id: "a" world_size: 4 mode: PERIODIC levels { period: 4 group_size: 4 } }
jobs { job_id: "b" world_size: 8 warmup_steps: 3 mode: HIERARCHICAL
       levels { period: 2 group_size: 2 } levels { period: 4 group_size: 8 } }
