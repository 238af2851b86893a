# MMSegmentation's UperNet R50 on ADE20K (mmseg::upernet), with the gradient
# all-reduce made explicit: the fp32 reference the compressed variants are
# compared with. Put ADE20K under data/ade/ADEChallengeData2016 as for
# MMSegmentation and run, e.g.
#   bash tools/dist_train.sh configs/upernet/<this file> 4
_base_ = [
    'mmseg::upernet/upernet_r50_4xb4-160k_ade20k-512x512.py',
    '../_base_/comm_hook.py'
]
comm_hook = dict(type='allreduce')
